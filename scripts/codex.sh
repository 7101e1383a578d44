#!/usr/bin/env bash
# Codex CLI, the pinned npm package, in a cache (for tests/test_codex.py and the whole-harness tests):
# prints the path of its `codex` command (bin/codex.js, run by Node.js as `npm install -g` users run it).
# The package ships a native binary per platform as an optional dependency (`@openai/codex-linux-x64` is
# `@openai/codex@VERSION-linux-x64`): npm only fetches it (no install script runs); codex.js finds and
# starts it. npm comes from Debian (scripts/system-deps.sh). AGENTSTREAM_CODEX, when set, names a codex.js
# to use instead.
set -euo pipefail
if [[ -n "${AGENTSTREAM_CODEX:-}" ]]; then
  [[ -f "$AGENTSTREAM_CODEX" ]] && { echo "$AGENTSTREAM_CODEX"; exit 0; }
  echo "AGENTSTREAM_CODEX=$AGENTSTREAM_CODEX is not a file: unset it to install Codex CLI" >&2; exit 1
fi
version=0.171.0
case "$(uname -m)" in x86_64) platform=linux-x64; triple=x86_64-unknown-linux-musl ;;
  aarch64) platform=linux-arm64; triple=aarch64-unknown-linux-musl ;;
  *) echo "no Codex CLI binary for $(uname -m)" >&2; exit 1 ;; esac
prefix="${AGENTSTREAM_HOME:-$HOME/.cache/agentstream}/codex/$version"
command="$prefix/node_modules/@openai/codex/bin/codex.js"
if [[ ! -x "$prefix/node_modules/@openai/codex-$platform/vendor/$triple/bin/codex" ]]; then
  command -v npm >/dev/null || { echo "npm is needed to install Codex CLI: run \`scripts/system-deps.sh\`" >&2; exit 1; }
  echo "installing @openai/codex@$version into $prefix…" >&2
  npm install --prefix "$prefix" --no-audit --no-fund --ignore-scripts --loglevel=error \
    "@openai/codex@$version" >&2
fi
"$command" --version >/dev/null
echo "$command"
