#!/usr/bin/env bash
# Claude Code, the pinned npm package, in a cache (for tests/gateway/test_claude_code.py): prints its binary's path.
# The package ships a native binary per platform as an optional dependency: npm only fetches it (no install
# script runs, no Node.js runs it). npm comes from Debian (scripts/system-deps.sh). AGENTSTREAM_CLAUDE_CODE,
# when set, names a binary to use instead.
set -euo pipefail
if [[ -n "${AGENTSTREAM_CLAUDE_CODE:-}" ]]; then
  [[ -x "$AGENTSTREAM_CLAUDE_CODE" ]] && { echo "$AGENTSTREAM_CLAUDE_CODE"; exit 0; }
  echo "AGENTSTREAM_CLAUDE_CODE=$AGENTSTREAM_CLAUDE_CODE is not an executable: unset it to install Claude Code" >&2; exit 1
fi
version=2.1.332
case "$(uname -m)" in x86_64) platform=linux-x64 ;; aarch64) platform=linux-arm64 ;;
  *) echo "no Claude Code binary for $(uname -m)" >&2; exit 1 ;; esac
prefix="${AGENTSTREAM_HOME:-$HOME/.cache/agentstream}/claude-code/$version"
binary="$prefix/node_modules/@anthropic-ai/claude-code-$platform/claude"
if [[ ! -x "$binary" ]]; then
  command -v npm >/dev/null || { echo "npm is needed to install Claude Code: run \`scripts/system-deps.sh\`" >&2; exit 1; }
  echo "installing @anthropic-ai/claude-code@$version into $prefix…" >&2
  npm install --prefix "$prefix" --no-audit --no-fund --ignore-scripts --loglevel=error \
    "@anthropic-ai/claude-code@$version" >&2
fi
"$binary" --version >/dev/null
echo "$binary"
