#!/usr/bin/env bash
# The whole test suite: unit, conformance, fence torture (on ext4, xfs and btrfs
# backing filesystems), force, crash and end-to-end tests on real loop devices.
# Needs root (loop devices, mounts).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "test: checking the tools the tests need" >&2
bash scripts/setup.sh
echo "test: building and running the suite (a first run takes about 10 minutes on 2 cores, most of it building)" >&2
exec cargo test --workspace --locked "$@"
