#!/usr/bin/env bash
# opencode, the pinned npm package (`opencode-ai`), in a cache (for the whole-harness tests): prints its binary's path.
# The package ships a native binary per platform as an optional dependency (`opencode-linux-x64`): npm only fetches
# it (no install script runs: the binary is used where npm put it). npm comes from Debian (scripts/system-deps.sh).
# AGENTSTREAM_OPENCODE, when set, names a binary to use instead.
set -euo pipefail
if [[ -n "${AGENTSTREAM_OPENCODE:-}" ]]; then
  [[ -x "$AGENTSTREAM_OPENCODE" ]] && { echo "$AGENTSTREAM_OPENCODE"; exit 0; }
  echo "AGENTSTREAM_OPENCODE=$AGENTSTREAM_OPENCODE is not an executable: unset it to install opencode" >&2; exit 1
fi
version=1.18.33
case "$(uname -m)" in x86_64) platform=linux-x64 ;; aarch64) platform=linux-arm64 ;;
  *) echo "no opencode binary for $(uname -m)" >&2; exit 1 ;; esac
prefix="${AGENTSTREAM_HOME:-$HOME/.cache/agentstream}/opencode/$version"
binary="$prefix/node_modules/opencode-$platform/bin/opencode"
if [[ ! -x "$binary" ]]; then
  command -v npm >/dev/null || { echo "npm is needed to install opencode: run \`scripts/system-deps.sh\`" >&2; exit 1; }
  echo "installing opencode-ai@$version into $prefix…" >&2
  npm install --prefix "$prefix" --no-audit --no-fund --ignore-scripts --loglevel=error "opencode-ai@$version" >&2
fi
# its --version writes only under HOME: a throwaway one
home="$(mktemp -d)"
trap 'rm -rf "$home"' EXIT
HOME="$home" OPENCODE_DISABLE_AUTOUPDATE=1 OPENCODE_DISABLE_MODELS_FETCH=1 "$binary" --version >/dev/null
echo "$binary"
