#!/usr/bin/env bash
# Installs what fencecsi's drill and tests need on a fresh Debian/Ubuntu
# machine: filesystem tools and the loop driver. Safe to run again.
set -euo pipefail

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    echo "setup: $* needs root (run as root or install sudo)" >&2; exit 1; fi
}

need=()
command -v mkfs.ext4 >/dev/null 2>&1 || [ -x /usr/sbin/mkfs.ext4 ] || need+=(e2fsprogs)
command -v mkfs.xfs >/dev/null 2>&1 || [ -x /usr/sbin/mkfs.xfs ] || need+=(xfsprogs)
command -v losetup >/dev/null 2>&1 || [ -x /usr/sbin/losetup ] || need+=(util-linux)
command -v filefrag >/dev/null 2>&1 || [ -x /usr/sbin/filefrag ] || need+=(e2fsprogs)
if [ "${#need[@]}" -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
[ -e /dev/loop-control ] || as_root modprobe loop || {
  echo "setup: /dev/loop-control is missing and the loop module could not be loaded" >&2; exit 1; }
command -v cargo >/dev/null || { echo "setup: cargo (Rust toolchain) is required" >&2; exit 1; }
