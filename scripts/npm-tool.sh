#!/usr/bin/env bash
# The coding harnesses distributed on npm, each at its pinned version, installed once into a cache (for the
# tests and the whole-harness mode): `scripts/npm-tool.sh NAME` prints the path of NAME's command.
#   claude-code  @anthropic-ai/claude-code: its native binary (no Node.js runs it)
#   codex        @openai/codex: bin/codex.js, run by Node.js as `npm install -g` users run it; it finds and
#                starts the native binary (`@openai/codex-linux-x64` is `@openai/codex@VERSION-linux-x64`)
#   opencode     opencode-ai: its native binary (`opencode-linux-x64`, a Bun executable)
# Each package ships its native binary per platform as an optional dependency: npm only fetches it (no install
# script runs). npm comes from Debian (scripts/system-deps.sh). The tool's variable (AGENTSTREAM_CLAUDE_CODE,
# AGENTSTREAM_CODEX, AGENTSTREAM_OPENCODE), when set, names a command to use instead.
set -euo pipefail
usage="usage: scripts/npm-tool.sh claude-code|codex|opencode"
[[ $# -eq 1 ]] || { echo "$usage" >&2; exit 2; }
case "$(uname -m)" in
  x86_64) arch=x64 triple=x86_64-unknown-linux-musl ;;
  aarch64) arch=arm64 triple=aarch64-unknown-linux-musl ;;
  *) echo "no binary of $1 for $(uname -m)" >&2; exit 1 ;;
esac
# NAME) its variable, its package and pinned version, its command and the native binary (under node_modules)
case "$1" in
  claude-code) variable=AGENTSTREAM_CLAUDE_CODE package=@anthropic-ai/claude-code version=2.1.332
    command=@anthropic-ai/claude-code-linux-$arch/claude native=@anthropic-ai/claude-code-linux-$arch/claude ;;
  codex) variable=AGENTSTREAM_CODEX package=@openai/codex version=0.171.0
    command=@openai/codex/bin/codex.js native=@openai/codex-linux-$arch/vendor/$triple/bin/codex ;;
  opencode) variable=AGENTSTREAM_OPENCODE package=opencode-ai version=1.18.33
    command=opencode-linux-$arch/bin/opencode native=opencode-linux-$arch/bin/opencode ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
if [[ -n "${!variable:-}" ]]; then
  [[ -x "${!variable}" ]] && { echo "${!variable}"; exit 0; }
  echo "$variable=${!variable} is not an executable: unset it to install $1" >&2; exit 1
fi
prefix="${AGENTSTREAM_HOME:-$HOME/.cache/agentstream}/$1/$version"
if [[ ! -x "$prefix/node_modules/$native" ]]; then
  command -v npm >/dev/null || { echo "npm is needed to install $1: run \`scripts/system-deps.sh\`" >&2; exit 1; }
  echo "installing $package@$version into $prefix…" >&2
  npm install --prefix "$prefix" --no-audit --no-fund --ignore-scripts --loglevel=error "$package@$version" >&2
fi
# it runs: --version, with a throwaway HOME (opencode writes its state there; Codex refuses one under /tmp)
home="$(mktemp -d "$prefix/home.XXXXXX")"
trap 'rm -rf "$home"' EXIT
HOME="$home" OPENCODE_DISABLE_AUTOUPDATE=1 OPENCODE_DISABLE_MODELS_FETCH=1 DISABLE_AUTOUPDATER=1 \
  "$prefix/node_modules/$command" --version >/dev/null
echo "$prefix/node_modules/$command"
