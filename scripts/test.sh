#!/usr/bin/env bash
# The whole test suite: unit, conformance, fence torture (on ext4, xfs and btrfs
# backing filesystems), force, crash and end-to-end tests on real loop devices.
# Needs root (loop devices, mounts).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  # Without root the kernel tests (loop devices, mounts) could only skip, and a
  # green run would prove little.
  echo "test: needs root for loop devices and mounts: sudo bash scripts/test.sh" >&2
  exit 1
fi
echo "test: checking the tools the tests need" >&2
bash scripts/setup.sh --tests
# A one-off build gains nothing from incremental artefacts, and they were a
# third of the build's disk use.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# The Python grpcio client test installs grpcio from PyPI; here it must run, not skip.
export FENCECSI_REQUIRE_GRPCIO="${FENCECSI_REQUIRE_GRPCIO:-1}"
if [ -n "${FENCECSI_E2E_K8S_BIN:-}" ] && [ -n "${FENCECSI_E2E_IMAGES:-}" ]; then
  echo "test: the real-kubelet suite (e2e/) runs: Kubernetes from $FENCECSI_E2E_K8S_BIN, images from $FENCECSI_E2E_IMAGES (about 10 more minutes)" >&2
else
  echo "test: the real-kubelet suite (e2e/) will say SKIPPED: set FENCECSI_E2E_K8S_BIN and FENCECSI_E2E_IMAGES to run it (DEVELOPERS.md)" >&2
fi
if [ -n "${FENCECSI_E2E_UPSTREAM_SUITE:-}" ]; then
  echo "test: Kubernetes' own storage suite (e2e/tests/upstream_storage.rs) runs too, with $FENCECSI_E2E_UPSTREAM_SUITE (docs/conformance.md; most of an hour for its two driver definitions)" >&2
fi
echo "test: disk free for the build and the tests' images: $(df -h --output=avail . | tail -1 | tr -d ' ')" >&2
echo "test: building and running the suite (a first run takes about 20 minutes on 2 cores, most of it building, the image's release build and debootstrap included)" >&2
exec cargo test --workspace --locked --no-fail-fast "$@"
