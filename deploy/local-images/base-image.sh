#!/usr/bin/env bash
# A Debian base image with python3 (3.11) and its venv module, made with debootstrap where no
# image registry is reachable: `deploy/local-images/base-image.sh [TAG]` (root; about a
# minute). The host's own extra CA certificates (/usr/local/share/ca-certificates) go in,
# so pip and apt inside trust what the host trusts.
set -euo pipefail
tag=${1:-tandem-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if docker image inspect "$tag" >/dev/null 2>&1; then echo "$tag: present"; exit 0; fi
command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap; }
root=$(mktemp -d /var/tmp/tandem-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$root" "$mirror" >/dev/null
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null
fi
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import - "$tag" >/dev/null
echo "$tag: made"
