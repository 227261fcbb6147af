#!/usr/bin/env bash
# Builds the fencecsi image, fencecsi:0.1.0, from this checkout without Docker:
# the three release binaries, a Debian bookworm root filesystem made by debootstrap with
# the packages deploy/Dockerfile installs, and the Dockerfile's config (USER, ENTRYPOINT,
# CMD), packed as a docker-archive that `ctr -n k8s.io images import`, `kind load
# image-archive` and `docker load` accept. deploy/Dockerfile is the single source of the
# package list and the config (scripts/pack-image.py reads both from it).
#
#   sudo bash scripts/image.sh            # prints the archive's path on stdout
#   FENCECSI_IMAGE_OUT=/tmp/x.tar sudo bash scripts/image.sh
#
# The root filesystem is cached under target/image/ (keyed by the package list and the
# mirror), so a rerun only rebuilds the binaries (if the sources changed) and repacks.
# Needs root (debootstrap), debootstrap and python3 >= 3.11.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "image: $*" >&2; }

TAG="${FENCECSI_IMAGE_TAG:-fencecsi:0.1.0}"
OUT="${FENCECSI_IMAGE_OUT:-$PWD/target/image/fencecsi-0.1.0.tar}"
MIRROR="${FENCECSI_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
BINARIES=(fencecsi-driver fencecsi-attacher fencecsi-podgc)

if [ "$(id -u)" -ne 0 ]; then
  say "needs root (debootstrap makes device nodes and chroots): sudo bash scripts/image.sh"
  exit 1
fi
for tool in debootstrap python3; do
  command -v "$tool" >/dev/null || [ -x "/usr/sbin/$tool" ] || {
    say "$tool is missing (apt-get install debootstrap python3)"; exit 1; }
done

packages="$(python3 scripts/pack-image.py packages deploy/Dockerfile)"
say "packages from deploy/Dockerfile: $packages"

key="$(printf '%s\n%s\n%s\n' "$SUITE" "$MIRROR" "$packages" | sha256sum | cut -c1-16)"
cache="$PWD/target/image/rootfs-$key"
# The marker sits beside the tree, so it never lands in the image.
done_marker="$cache.complete"
if [ -f "$done_marker" ]; then
  say "root filesystem cached: $cache"
else
  say "making the root filesystem with debootstrap (minbase, $SUITE; a few minutes on a first run)"
  rm -rf "$cache" "$cache.partial" "$done_marker"
  mkdir -p "$(dirname "$cache")"
  # debootstrap's own progress lines go to stderr as they come.
  debootstrap --variant=minbase --include="$(echo "$packages" | tr ' ' ',')" \
    "$SUITE" "$cache.partial" "$MIRROR" >&2
  # What the Dockerfile's `rm -rf /var/lib/apt/lists/*` leaves out, and the .debs.
  rm -rf "$cache.partial"/var/lib/apt/lists/* "$cache.partial"/var/cache/apt/archives/*.deb
  mv "$cache.partial" "$cache"
  touch "$done_marker"
  say "root filesystem ready: $cache"
fi

say "building the release binaries (cargo build --release --locked; minutes on a first run)"
pkgs=()
for b in "${BINARIES[@]}"; do pkgs+=(-p "$b"); done
cargo build --release --locked "${pkgs[@]}" >&2
adds=()
for b in "${BINARIES[@]}"; do
  [ -x "target/release/$b" ] || { say "target/release/$b was not built"; exit 1; }
  adds+=(--add "target/release/$b:/usr/local/bin/$b")
done

# The binaries are built on this machine and run on the root filesystem's libraries: a
# host with a newer glibc than bookworm's builds binaries that do not start there. Run
# each once in the root filesystem (chroot) before packing it.
probe_dir="$cache/tmp/fencecsi-image-probe.$$"
trap 'rm -rf "$probe_dir"' EXIT
mkdir -p "$probe_dir"
for b in "${BINARIES[@]}"; do
  cp "target/release/$b" "$probe_dir/$b"
  if ! out="$(chroot "$cache" "/tmp/$(basename "$probe_dir")/$b" --version 2>&1)"; then
    say "target/release/$b does not run on $SUITE's libraries: $out"
    say "build on $SUITE (or older), or with: docker build -f deploy/Dockerfile -t $TAG ."
    exit 1
  fi
done
rm -rf "$probe_dir"
say "the binaries run on $SUITE's libraries"

say "packing $TAG into $OUT"
python3 scripts/pack-image.py pack --tag "$TAG" --rootfs "$cache" "${adds[@]}" \
  --config-from deploy/Dockerfile --out "$OUT" >/dev/null
say "done: $TAG ($(du -h "$OUT" | cut -f1))"
echo "$OUT"
