#!/usr/bin/env bash
# The local failover drill: embedded cluster, real driver, attacher and podgc on real
# loop devices; node A shuts down while its writers keep writing. Prints the timeline
# and the figures; exits non-zero if a record was lost, a byte reached the fenced
# generation, or a step timed out. Flags: --nodes N --volumes N --fs ext4|xfs --json
# --step-timeout S --unsafe-pod (see --help). Needs root (loop devices, mounts).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  echo "drill: needs root (it attaches loop devices and mounts filesystems); run: sudo bash scripts/drill.sh $*" >&2
  exit 1
fi
bash scripts/setup.sh
exec cargo run --release --locked -q -p fencecsi-drill -- "$@"
