#!/usr/bin/env bash
# Installs what fencecsi's drill and tests need on a fresh Debian/Ubuntu
# machine: filesystem tools (ext4, xfs, btrfs: the fence is tested on each
# as a backing filesystem) and the loop driver; with --tests also containerd,
# runc and debootstrap (the image test). Safe to run again; says what
# it does, waits (bounded) for another apt to finish, retries once, and
# shows apt's own error when it fails.
set -euo pipefail

say() { echo "setup: $*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    say "$* needs root (run as root or install sudo)"; exit 1; fi
}

have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]; }

# Waits up to APT_LOCK_WAIT seconds (default 300) for another apt/dpkg.
# Whether another package manager runs. fuser (psmisc) names the lock holder
# exactly; before psmisc is installed, a process name check stands in.
apt_busy() {
  if have fuser; then
    fuser /var/lib/dpkg/lock-frontend /var/lib/dpkg/lock /var/lib/apt/lists/lock >/dev/null 2>&1
  else
    pgrep -x 'apt|apt-get|aptitude|dpkg|unattended-upgr' >/dev/null 2>&1
  fi
}

wait_for_apt() {
  local waited=0 limit="${APT_LOCK_WAIT:-300}"
  while apt_busy; do
    if [ "$waited" -eq 0 ]; then say "another apt/dpkg process holds the package lock; waiting up to ${limit}s"; fi
    if [ "$waited" -ge "$limit" ]; then say "still locked after ${limit}s; giving up"; return 1; fi
    sleep 2; waited=$((waited + 2))
  done
}

# Runs an apt command with its output in a log; on failure waits for the
# lock, retries once, then prints the log's tail.
apt_run() {
  local log; log=$(mktemp)
  for attempt in 1 2; do
    wait_for_apt || true
    if as_root env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=120 "$@" >"$log" 2>&1; then
      rm -f "$log"; return 0
    fi
    if [ "$attempt" -eq 1 ]; then say "apt-get $1 failed; retrying once"; sleep 3; fi
  done
  say "apt-get $* failed; its output:"
  tail -n 30 "$log" >&2
  rm -f "$log"
  return 1
}

need=()
have mkfs.ext4 || need+=(e2fsprogs)
have filefrag || need+=(e2fsprogs)
have mkfs.xfs || need+=(xfsprogs)
have mkfs.btrfs || need+=(btrfs-progs)
have losetup || need+=(util-linux)
have fuser || need+=(psmisc)
# --tests (scripts/test.sh): the image test (e2e/tests/image_in_containerd.rs) builds the
# image from this checkout (scripts/image.sh: debootstrap) and runs it under a containerd
# of its own. It needs no fetched binary (only a Debian mirror for debootstrap), so it
# runs on every machine, CI included.
if [ "${1:-}" = "--tests" ]; then
  have containerd || need+=(containerd)
  have runc || need+=(runc)
  have debootstrap || need+=(debootstrap)
  # podgc's fast-path tests stand a TLS server (openssl s_server) in for each kubelet.
  have openssl || need+=(openssl)
fi
# The real-kubelet suite (e2e/, DEVELOPERS.md) runs only when its inputs are given; then
# it also needs the CNI plugins, iptables for the nodes' Service DNAT and openssl.
if [ -n "${FENCECSI_E2E_K8S_BIN:-}" ] && [ -n "${FENCECSI_E2E_IMAGES:-}" ]; then
  { [ -x /usr/lib/cni/bridge ] || [ -x /opt/cni/bin/bridge ]; } || need+=(containernetworking-plugins)
  have iptables || need+=(iptables)
  have openssl || need+=(openssl)
  have nsenter || need+=(util-linux)
  # The upstream storage suite (e2e/tests/upstream_storage.rs) logs into the nodes over
  # SSH to restart their kubelets; each node runs its own sshd on its own address.
  if [ -n "${FENCECSI_E2E_UPSTREAM_SUITE:-}" ]; then
    [ -x /usr/sbin/sshd ] || need+=(openssh-server)
  fi
fi
if [ "${#need[@]}" -gt 0 ]; then
  mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
  say "installing ${need[*]} (apt-get update, then install; about a minute)"
  apt_run update
  # openssh-server is wanted for the e2e nodes' own sshds, never as the host's service:
  # while it installs, a policy-rc.d refusing service starts is in place (one already
  # there, as on container-built machines, is left as it is).
  made_policy=""
  if printf '%s\n' "${need[@]}" | grep -qx openssh-server && [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\n# fencecsi setup.sh: no service starts while it installs packages.\nexit 101\n' |
      as_root tee /usr/sbin/policy-rc.d >/dev/null
    as_root chmod 755 /usr/sbin/policy-rc.d
    made_policy=1
    trap 'as_root rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  apt_run install -y --no-install-recommends "${need[@]}"
  if [ -n "$made_policy" ]; then as_root rm -f /usr/sbin/policy-rc.d; trap - EXIT; fi
  say "installed ${need[*]}"
else
  say "filesystem tools present (ext4, xfs, btrfs, util-linux)"
fi
[ -e /dev/loop-control ] || as_root modprobe loop || {
  say "/dev/loop-control is missing and the loop module could not be loaded"; exit 1; }
command -v cargo >/dev/null || { say "cargo (Rust toolchain) is required"; exit 1; }
