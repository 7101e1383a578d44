#!/usr/bin/env bash
# Build agentstream's images from the Dockerfile: agentstream:<target> for each target named
# (default: all), each with its build time and size. The base image comes from base.sh (the official
# Python image, or a Debian-made stand-in where no registry answers). Layers and the uv/Maven cache
# mounts stay in the engine's store, so a second run only rebuilds what changed.
#   ENGINE   docker or podman (the Makefile's choice)
set -euo pipefail
cd "$(dirname "$0")/../.."
engine="${ENGINE:-podman}"
targets=("$@")
((${#targets[@]})) || targets=(services kafka trainer vllm-cpu swe-harness)
base="$(deploy/images/base.sh)"

# the build's steps as progress (podman: "[2/5] STEP 3/9: RUN …", BuildKit: "#7 [base 2/3] RUN …")
steps() {
  local line
  while IFS= read -r line; do
    if [[ $line =~ ^(\[[0-9]+/[0-9]+\]\ STEP|#[0-9]+\ \[) ]]; then echo "   ${line:0:140}"; fi
  done
}

started=$SECONDS
for target in "${targets[@]}"; do
  echo "── building agentstream:$target (FROM $base)…"
  at=$SECONDS
  log="${TMPDIR:-/tmp}/agentstream-build-$target.log"
  # all of the build's output in $log, its steps shown
  if ! "$engine" build --target "$target" --build-arg "PYTHON_IMAGE=$base" -t "agentstream:$target" . 2>&1 \
      | tee "$log" | steps; then
    echo "building agentstream:$target failed: see the end of $log" >&2; exit 1
  fi
  size="$("$engine" image inspect --format '{{.Size}}' "agentstream:$target")"
  printf '   agentstream:%s built in %ds, %s MB\n' "$target" $((SECONDS - at)) $((size / 1000000))
done
echo "images built in $((SECONDS - started))s"
