#!/bin/sh
# Build a base image for deploy/Dockerfile from Debian's packages alone, for a Docker engine
# that cannot pull from an image registry: debootstrap a minimal Debian with Python 3 into a
# directory and `docker import` it.
#
#   deploy/build-base-image.sh                      # as root; prints the image's name
#   docker build --network host -f deploy/Dockerfile \
#       --build-arg BASE=paramserve-base:bookworm -t paramserve:latest .
#
# Settings (environment):
#   IMAGE    name of the image to create            (default paramserve-base:bookworm)
#   SUITE    Debian release                         (default bookworm: Python 3.11)
#   MIRROR   Debian mirror                          (default http://deb.debian.org/debian)
#   ROOTFS   an empty or new scratch directory, removed at the end (default: a new one in /tmp)
#   EXTRA_CA_DIR  certificates (*.crt) this host trusts beyond Debian's, added to the image's
#            trust store so that pip inside `docker build` reaches the package index through
#            the same TLS-inspecting proxy as this host (default /usr/local/share/ca-certificates;
#            empty: add none)
# The image has python3 and python3-venv (the Dockerfile installs paramserve into a venv:
# Debian's own Python is externally managed) and ca-certificates, nothing else.
set -eu

IMAGE=${IMAGE:-paramserve-base:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
EXTRA_CA_DIR=${EXTRA_CA_DIR-/usr/local/share/ca-certificates}

if [ "$(id -u)" != 0 ]; then
    echo "$0: debootstrap needs root" >&2
    exit 1
fi
for tool in debootstrap docker; do
    if ! command -v "$tool" >/dev/null; then
        echo "$0: $tool not found (apt-get install debootstrap docker.io)" >&2
        exit 1
    fi
done

if [ -n "${ROOTFS:-}" ]; then
    if [ -e "$ROOTFS" ] && [ -n "$(ls -A "$ROOTFS")" ]; then
        echo "$0: ROOTFS=$ROOTFS is not empty" >&2
        exit 1
    fi
    mkdir -p "$ROOTFS"
else
    ROOTFS=$(mktemp -d "${TMPDIR:-/tmp}/paramserve-base.XXXXXX")
fi
# --one-file-system: never into what a failed debootstrap may have left mounted (/proc, /dev).
trap 'rm -rf --one-file-system "$ROOTFS"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$ROOTFS" "$MIRROR" >&2

if [ -n "$EXTRA_CA_DIR" ] && ls "$EXTRA_CA_DIR"/*.crt >/dev/null 2>&1; then
    cp "$EXTRA_CA_DIR"/*.crt "$ROOTFS/usr/local/share/ca-certificates/"
    chroot "$ROOTFS" update-ca-certificates >&2
fi
# What a container never needs: package lists, downloaded .debs, docs, man pages.
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/archives/*.deb \
    "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/*

tar -C "$ROOTFS" --numeric-owner -c . | docker import \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$IMAGE" >&2
echo "$IMAGE"
