#!/usr/bin/env bash
# The whole test suite: unit, conformance, fence torture, force, crash and
# end-to-end tests on real loop devices. Needs root (loop devices, mounts).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec cargo test --workspace --locked "$@"
