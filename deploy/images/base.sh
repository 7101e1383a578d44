#!/usr/bin/env bash
# The image every agentstream stage builds FROM (the Dockerfile's PYTHON_IMAGE), printed as its name.
#
# Where Docker Hub answers, that is the official python:3.11-slim-bookworm, pulled. Where no registry
# is reachable, a stand-in is made from Debian's packages instead: a bookworm root filesystem
# (debootstrap, from the Debian mirror apt already uses) with Debian's Python 3.11, arranged like the
# official image (`python` and `pip` on PATH, pip allowed to install system-wide, the security
# updates enabled), imported once and kept as agentstream/python:3.11-bookworm. Certificate
# authorities this host trusts beyond Debian's (a site's TLS-inspecting proxy in front of the package
# registries) are added to it, so pip, uv, cargo and Maven in the builds trust what the host does.
#   ENGINE   docker or podman (the Makefile's choice)
set -euo pipefail
engine="${ENGINE:-podman}"
official="docker.io/library/python:3.11-slim-bookworm"
local_base="localhost/agentstream/python:3.11-bookworm"
raw_base="localhost/agentstream/debian-python:bookworm"  # the debootstrap import, before the host's CAs
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

has() { "$engine" image inspect "$1" >/dev/null 2>&1; }
if has "$official"; then echo "$official"; exit 0; fi
if has "$local_base"; then echo "$local_base"; exit 0; fi
if "$engine" pull -q "$official" >/dev/null 2>&1; then echo "$official"; exit 0; fi

if ! has "$raw_base"; then
  command -v debootstrap >/dev/null || { echo "Docker Hub is unreachable and debootstrap is missing: run \`make container-tools\`" >&2; exit 1; }
  echo "Docker Hub is unreachable: building $local_base from Debian bookworm with debootstrap (once: 1.5 min on idle cores)…" >&2
  root="$(mktemp -d)"
  trap 'rm -rf "$root"' EXIT
  debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,python-is-python3,ca-certificates \
    bookworm "$root" "$mirror" >&2
  cat > "$root/etc/apt/sources.list" <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
SOURCES
  # the official image's Python is its own, so pip installs system-wide there; Debian's refuses (PEP 668)
  rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
  # as in Debian's official images: no documentation, no package lists, no apt caches
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* "$root"/usr/share/man/*
  tar -C "$root" -c . | "$engine" import --change 'CMD ["python3"]' --change 'ENV LANG=C.UTF-8' - "$raw_base" >&2
fi

# the host's extra authorities: PEM blocks of its bundle that Debian's does not have
context="$(mktemp -d)"
trap 'rm -rf "$context" "${root:-}"' EXIT
mkdir "$context/cas"
"$engine" run --rm "$raw_base" cat /etc/ssl/certs/ca-certificates.crt > "$context/debian.crt"
python3 - "${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}" "$context/debian.crt" "$context/cas" <<'PY'
import re, sys
from pathlib import Path
blocks = lambda path: set(re.findall(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----",
                                     Path(path).read_text() if Path(path).exists() else "", re.S))
for n, pem in enumerate(sorted(blocks(sys.argv[1]) - blocks(sys.argv[2]))):
    Path(sys.argv[3], f"host-{n}.crt").write_text(pem + "\n")
PY
echo "adding $(ls "$context/cas" | wc -l) certificate authorities of this host to $local_base" >&2
cat > "$context/Containerfile" <<DOCKERFILE
FROM $raw_base
COPY cas/ /usr/local/share/ca-certificates/
# uv trusts its own bundled roots unless pointed at the system's
RUN update-ca-certificates >/dev/null
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
DOCKERFILE
"$engine" build -q -t "$local_base" "$context" >&2
echo "$local_base"
