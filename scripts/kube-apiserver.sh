#!/usr/bin/env bash
# Build a real kube-apiserver from the Go module proxy (no binary downloads), for the Kubernetes
# launcher's and sandbox's tests (`make test` runs it). Prints the binary's path (AGENTSTREAM_KUBE_APISERVER's
# when that is set). Cached: a second run only prints the path.
#
# k8s.io/kubernetes points its k8s.io/* dependencies at ./staging with replace directives, and a
# module zip leaves staging out; so the build drops those replaces and requires the published
# staging modules at the matching v0.x version instead.
set -euo pipefail
version="${KUBE_VERSION:-1.37.2}"
# the Go that builds it where the machine's Go predates toolchain switching (1.21; Debian 12's is 1.19)
toolchain=go1.26.8
if [ -n "${AGENTSTREAM_KUBE_APISERVER:-}" ]; then
  [ -x "$AGENTSTREAM_KUBE_APISERVER" ] && { echo "$AGENTSTREAM_KUBE_APISERVER"; exit 0; }
  echo "AGENTSTREAM_KUBE_APISERVER=$AGENTSTREAM_KUBE_APISERVER is not an executable: unset it to build one" >&2; exit 1
fi
out="${AGENTSTREAM_HOME:-$HOME/.cache/agentstream}/kube/v${version}"
binary="$out/kube-apiserver"
if [ -x "$binary" ]; then echo "$binary"; exit 0; fi
command -v go >/dev/null || { echo "Go is needed to build kube-apiserver: run \`scripts/system-deps.sh\` (Debian's golang-go)" >&2; exit 1; }
# a Go from 1.21 on fetches the newer Go that kube-apiserver's go.mod asks for (from the Go module proxy,
# as a module), also where the machine pins its own (GOTOOLCHAIN=local); an older one fetches it here
export GOTOOLCHAIN=auto
if ! go version | grep -qE 'go1\.(2[1-9]|[3-9][0-9])|go[2-9]'; then
  echo "Go $(go env GOVERSION) is older than 1.21: fetching $toolchain from the Go module proxy to build with…" >&2
  module="golang.org/toolchain@v0.0.1-${toolchain}.$(go env GOOS)-$(go env GOARCH)"
  goroot="$(go mod download -json "$module" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')"
  chmod u+x "$goroot"/bin/* "$goroot"/pkg/tool/*/*  # module files are unpacked without their execute bits
  export PATH="$goroot/bin:$PATH" GOROOT="$goroot"
fi

work="$(mktemp -d)"
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
echo "building kube-apiserver v${version} from the Go module proxy (first run only, several minutes)…" >&2
src="$(GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@v${version}" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')"
cp -r "$src" "$work/k" && chmod -R u+w "$work/k"
cd "$work/k"
rm -rf vendor go.work go.work.sum
staging_version="v0.${version#1.}"
go mod edit -json > "$work/mod.json"
python3 - "$work/mod.json" "$staging_version" > "$work/edits" <<'PY'
import json, sys
mod = json.load(open(sys.argv[1]))
for replace in mod.get("Replace") or []:
    if replace["New"]["Path"].startswith("./staging"):
        path = replace["Old"]["Path"]
        print(f"-dropreplace={path}")
        print(f"-require={path}@{sys.argv[2]}")
PY
xargs go mod edit < "$work/edits"
GOFLAGS=-mod=mod go build -o "$work/kube-apiserver" ./cmd/kube-apiserver >&2
mkdir -p "$out"
mv "$work/kube-apiserver" "$binary"
echo "$binary"
