#!/usr/bin/env python3
"""Packs a one-layer container image as a docker-archive tar, without Docker.

The archive (manifest.json, repositories, the image config and one uncompressed layer)
is what `docker save` writes; `ctr -n k8s.io images import`, `kind load image-archive`
and `docker load` all read it.

    pack-image.py pack --tag fencecsi:0.1.0 --rootfs DIR --add SRC:/usr/local/bin/x \
        --config-from deploy/Dockerfile --out fencecsi.tar
    pack-image.py pack --tag registry.k8s.io/sig-storage/livenessprobe:v2.19.0 \
        --add bin/livenessprobe:/livenessprobe --entrypoint '["/livenessprobe"]' --out x.tar
    pack-image.py from-list entrypoints.txt --bin-dir bin --out-dir images   # one per line
    pack-image.py packages deploy/Dockerfile     # the runtime stage's apt-get install list

deploy/Dockerfile is the single source of the runtime image: its packages (the
`apt-get install` line of the last stage) and its config (USER, ENTRYPOINT, CMD of the
last stage) are read from it here, so scripts/image.sh and `docker build` cannot drift.

Python 3.11 standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shlex
import stat
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# debian:bookworm-slim's PATH; the manifests name binaries without a path.
DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Never part of an image: mount points the runtime fills, and apt's caches.
SKIP_CONTENTS = ("proc", "sys", "dev/pts", "run", "tmp", "var/cache/apt/archives", "var/lib/apt/lists")


@dataclass
class ImageConfig:
    user: str | None = None
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    env: list[str] = field(default_factory=lambda: [DEFAULT_PATH])


def last_stage(dockerfile: Path) -> list[str]:
    """The logical lines (continuations joined) of the Dockerfile's last stage."""
    lines: list[str] = []
    cur = ""
    for raw in dockerfile.read_text().splitlines():
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        lines.append(cur + s)
        cur = ""
    starts = [i for i, l in enumerate(lines) if l.upper().startswith("FROM ")]
    if not starts:
        raise SystemExit(f"pack-image: {dockerfile} has no FROM")
    return lines[starts[-1]:]


def dockerfile_packages(dockerfile: Path) -> list[str]:
    """The packages of the last stage's `apt-get install`, options dropped."""
    for line in last_stage(dockerfile):
        if "apt-get install" not in line:
            continue
        tail = line.split("apt-get install", 1)[1]
        pkgs = []
        for tok in shlex.split(tail.split("&&", 1)[0]):
            if tok.startswith("-"):
                continue
            pkgs.append(tok)
        if pkgs:
            return pkgs
    raise SystemExit(f"pack-image: no apt-get install in the last stage of {dockerfile}")


def dockerfile_config(dockerfile: Path) -> ImageConfig:
    """USER, ENTRYPOINT and CMD of the last stage (exec form only, as the Dockerfile uses)."""
    cfg = ImageConfig()
    for line in last_stage(dockerfile):
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "USER":
            cfg.user = rest.strip()
        elif word in ("ENTRYPOINT", "CMD"):
            try:
                value = json.loads(rest)
            except json.JSONDecodeError as e:
                raise SystemExit(f"pack-image: {word} must be in exec (JSON) form: {rest!r}: {e}")
            if word == "ENTRYPOINT":
                cfg.entrypoint = value
            else:
                cfg.cmd = value
    return cfg


def skipped(rel: str) -> bool:
    """Whether the rootfs path `rel` is content the image never carries."""
    return any(rel.startswith(s + "/") for s in SKIP_CONTENTS)


def add_rootfs(tar: tarfile.TarFile, rootfs: Path) -> None:
    """Adds the tree under `rootfs` with numeric owners, symlinks and hard links kept."""
    paths = []
    for dirpath, dirnames, filenames in os.walk(rootfs):
        dirnames.sort()
        for name in dirnames + sorted(filenames):
            paths.append(Path(dirpath) / name)
    for p in sorted(paths, key=lambda p: str(p.relative_to(rootfs))):
        rel = str(p.relative_to(rootfs))
        if skipped(rel):
            continue
        info = tar.gettarinfo(str(p), arcname=rel)
        info.uname = info.gname = ""
        if info.isreg():
            with open(p, "rb") as f:
                tar.addfile(info, f)
        else:
            tar.addfile(info)


def add_file(tar: tarfile.TarFile, src: Path, dest: str, mode: int | None = None) -> None:
    """Adds `src` at `dest` (absolute in the image), root-owned, its parents as dirs."""
    dest = dest.lstrip("/")
    parts = dest.split("/")[:-1]
    have = set(tar.getnames())
    for i in range(1, len(parts) + 1):
        d = "/".join(parts[:i])
        if d not in have:
            di = tarfile.TarInfo(d)
            di.type = tarfile.DIRTYPE
            di.mode = 0o755
            tar.addfile(di)
    info = tarfile.TarInfo(dest)
    st = src.stat()
    info.size = st.st_size
    info.mode = mode if mode is not None else stat.S_IMODE(st.st_mode)
    info.mtime = int(st.st_mtime)
    with open(src, "rb") as f:
        tar.addfile(info, f)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_layer(rootfs: Path | None, adds: list[tuple[Path, str]], out: Path) -> None:
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        if rootfs is not None:
            add_rootfs(tar, rootfs)
        for src, dest in adds:
            add_file(tar, src, dest)


def host_arch() -> str:
    """The OCI name of this machine's architecture (what the binaries are built for)."""
    machine = os.uname().machine
    arch = {"x86_64": "amd64", "aarch64": "arm64", "i686": "386", "i386": "386",
            "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64"}.get(machine)
    if arch is None:
        # 32-bit ARM needs a variant too; better no image than a mislabelled one.
        raise SystemExit(f"pack-image: no OCI architecture known for {machine!r}: pass --arch")
    return arch


def image_config_json(cfg: ImageConfig, diff_id: str, arch: str) -> bytes:
    config: dict = {"Env": cfg.env, "WorkingDir": "/"}
    if cfg.user:
        config["User"] = cfg.user
    # Docker records `ENTRYPOINT []` as no entrypoint; the runtime then runs Cmd.
    config["Entrypoint"] = cfg.entrypoint if cfg.entrypoint else None
    config["Cmd"] = cfg.cmd if cfg.cmd else None
    doc = {
        "architecture": arch,
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id}"]},
        "history": [{"created_by": "scripts/pack-image.py"}],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def repo_and_tag(ref: str) -> tuple[str, str]:
    """`registry/name:tag` -> (`registry/name`, `tag`); a port's colon is not a tag."""
    name, sep, tag = ref.rpartition(":")
    if not sep or "/" in tag:
        raise SystemExit(f"pack-image: {ref!r} needs an explicit tag")
    return name, tag


def write_archive(out: Path, tag: str, layer: Path, config: bytes, diff_id: str) -> None:
    config_id = hashlib.sha256(config).hexdigest()
    layer_name = f"{diff_id}/layer.tar"
    manifest = [{"Config": f"{config_id}.json", "RepoTags": [tag], "Layers": [layer_name]}]
    repo, t = repo_and_tag(tag)
    repositories = {repo: {t: diff_id}}
    tmp = out.with_name(out.name + ".partial")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        def add_bytes(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))

        add_bytes(f"{config_id}.json", config)
        tar.add(str(layer), arcname=layer_name)
        add_bytes("manifest.json", json.dumps(manifest).encode())
        add_bytes("repositories", json.dumps(repositories).encode())
    tmp.replace(out)


def parse_add(spec: str) -> tuple[Path, str]:
    src, sep, dest = spec.partition(":")
    if not sep or not dest.startswith("/"):
        raise SystemExit(f"pack-image: --add wants SRC:/absolute/dest, got {spec!r}")
    if not Path(src).is_file():
        raise SystemExit(f"pack-image: --add source {src} is not a file")
    return Path(src), dest


def cmd_pack(args: argparse.Namespace) -> None:
    cfg = dockerfile_config(Path(args.config_from)) if args.config_from else ImageConfig()
    if args.user is not None:
        cfg.user = args.user
    if args.entrypoint is not None:
        cfg.entrypoint = json.loads(args.entrypoint)
    if args.cmd is not None:
        cfg.cmd = json.loads(args.cmd)
    adds = [parse_add(a) for a in args.add]
    rootfs = Path(args.rootfs) if args.rootfs else None
    if rootfs is not None and not rootfs.is_dir():
        raise SystemExit(f"pack-image: rootfs {rootfs} is not a directory")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".pack-") as td:
        layer = Path(td) / "layer.tar"
        print(f"pack-image: {args.tag}: writing the layer", file=sys.stderr, flush=True)
        build_layer(rootfs, adds, layer)
        diff_id = sha256_file(layer)
        config = image_config_json(cfg, diff_id, args.arch or host_arch())
        print(f"pack-image: {args.tag}: writing {out}", file=sys.stderr, flush=True)
        write_archive(out, args.tag, layer, config, diff_id)
    print(out)


def cmd_from_list(args: argparse.Namespace) -> None:
    """One image per line `<image-ref:tag> <binary> <entrypoint-path>` of the list."""
    bin_dir, out_dir = Path(args.bin_dir), Path(args.out_dir)
    for line in Path(args.list).read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        ref, binary, entry = line.split()
        name = ref.rsplit("/", 1)[-1].replace(":", "-")
        ns = argparse.Namespace(
            tag=ref, rootfs=None, add=[f"{bin_dir / binary}:{entry}"], config_from=None,
            user=None, entrypoint=json.dumps([entry]), cmd=None, out=str(out_dir / f"{name}.tar"),
            arch=None,
        )
        cmd_pack(ns)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="write a docker-archive of one layer")
    p.add_argument("--tag", required=True, help="full image reference with tag")
    p.add_argument("--rootfs", help="a directory to take whole as the layer's base")
    p.add_argument("--add", action="append", default=[], help="SRC:/dest, a file to add")
    p.add_argument("--config-from", help="a Dockerfile: USER/ENTRYPOINT/CMD of its last stage")
    p.add_argument("--user")
    p.add_argument("--entrypoint", help="JSON list")
    p.add_argument("--cmd", help="JSON list")
    p.add_argument("--out", required=True)
    p.add_argument("--arch", help="the image's architecture (OCI name); default: this machine's")
    p.set_defaults(func=cmd_pack)
    f = sub.add_parser("from-list", help="one static-binary image per line of an entrypoints list")
    f.add_argument("list", help="lines: <image-ref:tag> <binary> <entrypoint-path>")
    f.add_argument("--bin-dir", required=True, help="where the binaries are")
    f.add_argument("--out-dir", required=True)
    f.set_defaults(func=cmd_from_list)
    q = sub.add_parser("packages", help="print the last stage's apt-get install packages")
    q.add_argument("dockerfile")
    q.set_defaults(func=lambda a: print(" ".join(dockerfile_packages(Path(a.dockerfile)))))
    args = ap.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
