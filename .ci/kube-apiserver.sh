#!/usr/bin/env bash
# Build a real kube-apiserver from the Go module proxy (no binary downloads), for the Kubernetes
# launcher's tests. Prints the binary's path. Cached: a second run only prints the path.
#
# k8s.io/kubernetes points its k8s.io/* dependencies at ./staging with replace directives, and a
# module zip leaves staging out; so the build drops those replaces and requires the published
# staging modules at the matching v0.x version instead.
set -euo pipefail
version="${KUBE_VERSION:-1.37.2}"
out="${AGENTSTREAM_HOME:-$HOME/.cache/agentstream}/kube/v${version}"
binary="$out/kube-apiserver"
if [ -x "$binary" ]; then echo "$binary"; exit 0; fi
command -v go >/dev/null || { echo "Go is needed to build kube-apiserver" >&2; exit 1; }

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
