#!/usr/bin/env bash
# Build Helm from the Go module proxy (no binary downloads), for the chart's tests
# (tests/deploy/test_helm_chart.py) and for deploying it. Prints the binary's path. Cached: a second run
# only prints the path.
set -euo pipefail
version="${HELM_VERSION:-3.21.4}"
out="${AGENTSTREAM_HOME:-$HOME/.cache/agentstream}/helm/v${version}"
binary="$out/helm"
if [ -x "$binary" ]; then echo "$binary"; exit 0; fi
command -v go >/dev/null || { echo "Go is needed to build helm (or put helm on PATH, or set AGENTSTREAM_HELM)" >&2; exit 1; }
echo "building helm v${version} from the Go module proxy (first run only, a few minutes)…" >&2
mkdir -p "$out"
GOTOOLCHAIN=auto GOBIN="$out.partial" GOFLAGS=-mod=mod go install "helm.sh/helm/v3/cmd/helm@v${version}" >&2
mv "$out.partial/helm" "$binary" && rmdir "$out.partial"
echo "$binary"
