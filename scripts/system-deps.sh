#!/usr/bin/env bash
# Install the Debian packages of the given groups (default: test) that scripts/system-packages.txt lists
# and this machine lacks. Says in one line what it installs and why; where it cannot install (not root,
# no apt-get), stops with one line naming the command to run. Silent when nothing is missing.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
list="${SYSTEM_PACKAGES:-$here/system-packages.txt}"
groups=("${@:-test}")

present() {  # a command on PATH, or an absolute path that is executable
  if [[ "$1" == /* ]]; then [[ -x "$1" ]]; else command -v "$1" >/dev/null 2>&1; fi
}

packages=() commands=() reasons=()
while read -r group command package why; do
  [[ -z "$group" || "$group" == \#* ]] && continue
  [[ " ${groups[*]} " == *" $group "* ]] || continue
  present "$command" && continue
  [[ " ${packages[*]} " == *" $package "* ]] && { commands+=("$command"); continue; }
  commands+=("$command")
  packages+=("$package")
  reasons+=("$package ($command: $why)")
done < "$list"

((${#packages[@]})) || exit 0
if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "missing system packages: run \`sudo apt-get install -y ${packages[*]}\` (or your system's equivalent), then again" >&2
  exit 1
fi
printf -v why '%s; ' "${reasons[@]}"
echo "installing ${packages[*]} from Debian: ${why%; }"
export DEBIAN_FRONTEND=noninteractive
apt=(apt-get -qq -o DPkg::Lock::Timeout=600)  # waits for another install to finish instead of failing
if ! { "${apt[@]}" update && "${apt[@]}" install -y "${packages[@]}"; } >/dev/null; then
  echo "could not install ${packages[*]}: run \`apt-get update && apt-get install -y ${packages[*]}\` to see why" >&2
  exit 1
fi
for command in "${commands[@]}"; do
  present "$command" || { echo "$command is still missing after the install: run \`apt-get install -y ${packages[*]}\` to see why" >&2; exit 1; }
done
