#!/usr/bin/env bash
# Claude Code, the pinned npm package, in a cache (for tests/test_claude_code.py): prints its binary's path.
# The package ships a native binary per platform as an optional dependency: npm only fetches it (no install
# script runs, no Node.js runs it). npm comes from Debian when missing.
set -euo pipefail
version=2.1.332
case "$(uname -m)" in x86_64) platform=linux-x64 ;; aarch64) platform=linux-arm64 ;;
  *) echo "no Claude Code binary for $(uname -m)" >&2; exit 1 ;; esac
prefix="${AGENTSTREAM_HOME:-$HOME/.cache/agentstream}/claude-code/$version"
binary="$prefix/node_modules/@anthropic-ai/claude-code-$platform/claude"
if [[ ! -x "$binary" ]]; then
  if ! command -v npm >/dev/null; then
    echo "installing npm (Debian)…" >&2
    (apt-get update -qq && apt-get install -y -qq npm) >/dev/null
  fi
  echo "installing @anthropic-ai/claude-code@$version into $prefix…" >&2
  npm install --prefix "$prefix" --no-audit --no-fund --ignore-scripts --loglevel=error \
    "@anthropic-ai/claude-code@$version" >&2
fi
"$binary" --version >/dev/null
echo "$binary"
