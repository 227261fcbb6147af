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
echo "drill: checking the tools it needs" >&2
bash scripts/setup.sh
echo "drill: building fencecsi-drill (release; the first build takes about 15 minutes on 2 cores, later ones seconds)" >&2
cargo build --release --locked -p fencecsi-drill
echo "drill: starting" >&2
exec ./target/release/fencecsi-drill "$@"
