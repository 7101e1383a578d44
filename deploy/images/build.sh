#!/usr/bin/env bash
# Build agentstream's images from the Dockerfile: agentstream:<target> for each target named
# (default: all), each with its build time and size. The base image comes from base.sh (the official
# Python image, or a Debian-made stand-in where no registry answers). Layers and the uv/Maven cache
# mounts stay in the engine's store, so a second run only rebuilds what changed; with podman, uv's
# cache is this host's own (below).
#   ENGINE   docker or podman (the Makefile's choice)
set -euo pipefail
cd "$(dirname "$0")/../.."
engine="${ENGINE:-podman}"
targets=("$@")
((${#targets[@]})) || targets=(services kafka trainer vllm-cpu swe-harness)
base="$(deploy/images/base.sh)"

# podman builds with this host's uv cache bound in (Docker's builds keep their own cache mount): after
# `make install` every wheel the images need is already there, so a cold build downloads none
build_args=(--build-arg "PYTHON_IMAGE=$base")
uv_cache="${UV_CACHE_DIR:-$(uv cache dir 2>/dev/null || echo "$HOME/.cache/uv")}"
if [[ $engine == podman ]]; then
  mkdir -p "$uv_cache"
  build_args+=(--volume "$uv_cache:/host-uv-cache" --build-arg UV_CACHE_DIR=/host-uv-cache)
fi

# the build's steps as progress (podman: "[2/5] STEP 3/9: RUN …", BuildKit: "#7 [base 2/3] RUN …")
steps() {
  local line
  while IFS= read -r line; do
    if [[ $line =~ ^(\[[0-9]+/[0-9]+\]\ STEP|#[0-9]+\ \[) ]]; then echo "   ${line:0:140}"; fi
  done
}

# podman: each image's dependency stage is built and tagged first (agentstream-build:<stage>), because
# `podman image prune` removes untagged stages, and with them the cached layers that spare a code
# change the reinstall of its dependencies (BuildKit keeps its cache apart from the images)
declare -A deps_stage=()
if [[ $engine == podman ]]; then
  deps_stage=([services]=deps [trainer]=deps-trainer [swe-harness]=deps-swe-harness [kafka]=kafka-jars)
fi
build() {  # <target> <tag> <log>: all of the build's output in the log, its steps shown
  "$engine" build --target "$1" "${build_args[@]}" -t "$2" . 2>&1 | tee -a "$3" | steps
}

# A build that retags an image leaves the image it replaced untagged: with every dependency change the
# trainer's 7.7 GB stayed behind, and a machine's disk filled after a few runs (a CI run ended in "no
# space left on device"). Untagged images go before and after building; the tagged dependency stages
# keep the layers that spare a code change its reinstall.
prune() { "$engine" image prune -f >/dev/null 2>&1 || echo "   (could not remove untagged images: $engine image prune)" >&2; }
NEED_GIB=16  # a rebuilt trainer's dependencies are written twice while committed (temporary blob, then store)
free_gib() { df -P --block-size=1G "$1" 2>/dev/null | awk 'NR==2 {print $4}'; }
check_space() {
  local store tmp
  store="$("$engine" info --format '{{.Store.GraphRoot}}' 2>/dev/null || echo /var/lib)"
  tmp="${TMPDIR:-/var/tmp}"
  for dir in "$store" "$tmp"; do
    local free; free="$(free_gib "$dir")"
    if [[ -n $free ]] && ((free < NEED_GIB)); then
      echo "warning: $free GiB free on $dir; a build that reinstalls the trainer's dependencies needs up to" \
           "$NEED_GIB GiB there (\`$engine system prune\` removes every image no container uses)" >&2
    fi
  done
}

started=$SECONDS
prune
check_space
for target in "${targets[@]}"; do
  echo "── building agentstream:$target (FROM $base)…"
  at=$SECONDS
  log="${TMPDIR:-/tmp}/agentstream-build-$target.log"
  : > "$log"
  stage="${deps_stage[$target]:-}"
  if { [[ -n $stage ]] && ! build "$stage" "agentstream-build:$stage" "$log"; } \
      || ! build "$target" "agentstream:$target" "$log"; then
    if grep -q "no space left on device" "$log"; then
      echo "building agentstream:$target ran out of disk: free space ($engine system prune removes every image" \
           "no container uses), then rerun; see the end of $log" >&2; exit 1
    fi
    echo "building agentstream:$target failed: see the end of $log" >&2; exit 1
  fi
  size="$("$engine" image inspect --format '{{.Size}}' "agentstream:$target")"
  # the load average with the time: on a shared machine a build's time says little without it
  printf '   agentstream:%s built in %ds, %s MB (load average %s)\n' "$target" $((SECONDS - at)) $((size / 1000000)) \
    "$(cut -d' ' -f1-3 /proc/loadavg)"
done
prune
echo "images built in $((SECONDS - started))s ($(free_gib /) GiB free on /)"
