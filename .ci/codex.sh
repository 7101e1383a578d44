#!/usr/bin/env bash
# Codex CLI, the pinned npm package, in a cache (for tests/test_codex.py and the whole-harness tests):
# prints the path of its `codex` command (bin/codex.js, run by Node.js as `npm install -g` users run it).
# The package ships a native binary per platform as an optional dependency (`@openai/codex-linux-x64` is
# `@openai/codex@VERSION-linux-x64`): npm only fetches it (no install script runs); codex.js finds and
# starts it. npm (and with it Node.js) comes from Debian when missing.
set -euo pipefail
version=0.171.0
case "$(uname -m)" in x86_64) platform=linux-x64; triple=x86_64-unknown-linux-musl ;;
  aarch64) platform=linux-arm64; triple=aarch64-unknown-linux-musl ;;
  *) echo "no Codex CLI binary for $(uname -m)" >&2; exit 1 ;; esac
prefix="${AGENTSTREAM_HOME:-$HOME/.cache/agentstream}/codex/$version"
command="$prefix/node_modules/@openai/codex/bin/codex.js"
if [[ ! -x "$prefix/node_modules/@openai/codex-$platform/vendor/$triple/bin/codex" ]]; then
  if ! command -v npm >/dev/null; then
    echo "installing npm (Debian)…" >&2
    (apt-get update -qq && apt-get install -y -qq npm) >/dev/null
  fi
  echo "installing @openai/codex@$version into $prefix…" >&2
  npm install --prefix "$prefix" --no-audit --no-fund --ignore-scripts --loglevel=error \
    "@openai/codex@$version" >&2
fi
"$command" --version >/dev/null
echo "$command"
