"""OCI image archives written by our own code (no registry, no image builder): layer tarballs made from
directories, and an OCI image layout (oci-layout, index.json, blobs) that `ctr image import` reads.

    python3 oci.py layer SRC_DIR OUT.tar [--exclude GLOB ...]   # prints the layer's sha256
    python3 oci.py image --name REF --config CONFIG.json --layer A.tar [--layer B.tar ...] --out IMAGE.tar
    python3 oci.py image --recipe IMAGE.json --out - | ctr -n k8s.io image import -   # streamed, no copy

Layers stay uncompressed: containerd takes them as they are, and gzip of a 4 GB torch layer would
cost minutes on a 2-core machine for no gain on one host. Each layer's digest is kept next to it
(OUT.tar.sha256), so assembling an image re-reads nothing."""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import json
import os
import sys
import tarfile
from pathlib import Path

MT_INDEX = "application/vnd.oci.image.index.v1+json"
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER = "application/vnd.oci.image.layer.v1.tar"


class _Hashing(io.RawIOBase):
    """A write-only file that hashes and counts what passes through to the real file."""

    def __init__(self, f):
        self.f, self.h, self.n = f, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.h.update(b)
        self.n += len(b)
        return self.f.write(b)


def make_layer(src: Path, out: Path, exclude: list[str]) -> str:
    """Tar SRC's tree (sorted, numeric owners, hard links kept) into OUT; return 'sha256:<hex>'."""
    if not src.is_dir():
        raise SystemExit(f"oci.py layer: {src} is not a directory")
    tmp = out.with_suffix(out.suffix + ".part")
    with open(tmp, "wb") as raw:
        sink = _Hashing(raw)
        with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for root, dirs, files in os.walk(src):
                dirs.sort()
                rel_root = os.path.relpath(root, src)
                for name in sorted(dirs) + sorted(files):
                    rel = os.path.normpath(os.path.join(rel_root, name))
                    if any(fnmatch.fnmatch(rel, g) for g in exclude):
                        if name in dirs:
                            dirs.remove(name)  # skip the subtree too
                        continue
                    path = os.path.join(root, name)
                    ti = tar.gettarinfo(path, arcname=rel)
                    if ti is None:  # a socket: nothing an image can carry
                        continue
                    ti.uname = ti.gname = ""
                    if ti.isreg():
                        with open(path, "rb") as f:
                            tar.addfile(ti, f)
                    else:
                        tar.addfile(ti)
    digest = f"sha256:{sink.h.hexdigest()}"
    tmp.rename(out)
    Path(f"{out}.sha256").write_text(digest)
    return digest


def _layer_digest(path: Path) -> str:
    side = Path(f"{path}.sha256")
    if side.exists() and side.stat().st_mtime >= path.stat().st_mtime:
        return side.read_text().strip()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return f"sha256:{h.hexdigest()}"


def _descriptor(mt: str, blob_digest: str, size: int, **extra) -> dict:
    return {"mediaType": mt, "digest": blob_digest, "size": size, **extra}


def make_image(name: str, config: dict, layers: list[Path], out: Path) -> str:
    """Write an OCI image layout tarball holding one image named NAME; return the manifest digest."""
    if ":" not in name.rsplit("/", 1)[-1]:
        raise SystemExit(f"oci.py image: --name {name!r} needs a tag (repository:tag)")
    for key in ("architecture", "os", "config"):
        if key not in config:
            raise SystemExit(f"oci.py image: the config has no {key!r}")
    digests = [_layer_digest(p) for p in layers]
    cfg = {**config, "rootfs": {"type": "layers", "diff_ids": digests}}
    cfg_blob = json.dumps(cfg, sort_keys=True).encode()
    cfg_digest = "sha256:" + hashlib.sha256(cfg_blob).hexdigest()
    manifest = {"schemaVersion": 2, "mediaType": MT_MANIFEST,
                "config": _descriptor(MT_CONFIG, cfg_digest, len(cfg_blob)),
                "layers": [_descriptor(MT_LAYER, d, p.stat().st_size) for d, p in zip(digests, layers)]}
    man_blob = json.dumps(manifest, sort_keys=True).encode()
    man_digest = "sha256:" + hashlib.sha256(man_blob).hexdigest()
    index = {"schemaVersion": 2, "mediaType": MT_INDEX, "manifests": [_descriptor(
        MT_MANIFEST, man_digest, len(man_blob),
        # containerd names the image from the first; other tools read the OCI tag.
        annotations={"io.containerd.image.name": name,
                     "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]})]}

    stream = str(out) == "-"
    tmp = out if stream else out.with_suffix(out.suffix + ".part")
    with (tarfile.open(fileobj=sys.stdout.buffer, mode="w|", format=tarfile.PAX_FORMAT) if stream
          else tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT)) as tar:
        def put(arc: str, data: bytes) -> None:
            ti = tarfile.TarInfo(arc)
            ti.size, ti.mode = len(data), 0o644
            tar.addfile(ti, io.BytesIO(data))

        put("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        put("index.json", json.dumps(index, sort_keys=True).encode())
        put(f"blobs/sha256/{man_digest[7:]}", man_blob)
        put(f"blobs/sha256/{cfg_digest[7:]}", cfg_blob)
        seen = set()
        for d, p in zip(digests, layers):
            if d in seen:
                continue
            seen.add(d)
            ti = tarfile.TarInfo(f"blobs/sha256/{d[7:]}")
            ti.size, ti.mode = p.stat().st_size, 0o644
            with open(p, "rb") as f:
                tar.addfile(ti, f)
    if not stream:
        tmp.rename(out)
    return man_digest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="oci.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("layer", help="tar a directory into an uncompressed OCI layer")
    lp.add_argument("src", type=Path)
    lp.add_argument("out", type=Path)
    lp.add_argument("--exclude", action="append", default=[], help="glob of paths relative to SRC to leave out")
    ip = sub.add_parser("image", help="assemble an OCI image layout tarball")
    ip.add_argument("--name", help="full reference, e.g. pdrollout.local/engine-cpu:0.1.0")
    ip.add_argument("--config", type=Path, help="image config JSON (architecture, os, config)")
    ip.add_argument("--layer", action="append", type=Path, default=[], help="layer tarball, base first")
    ip.add_argument("--recipe", type=Path, help='JSON {"name", "config", "layers"} instead of the three above')
    ip.add_argument("--out", required=True, type=Path, help="the image tarball, or - for stdout")
    a = ap.parse_args(argv)
    if a.cmd == "layer":
        print(make_layer(a.src, a.out, a.exclude))
    else:
        if a.recipe:
            r = json.loads(a.recipe.read_text())
            name, config, layers = r["name"], r["config"], [Path(p) for p in r["layers"]]
        elif a.name and a.config and a.layer:
            name, config, layers = a.name, json.loads(a.config.read_text()), a.layer
        else:
            raise SystemExit("oci.py image: give --recipe, or --name, --config and --layer")
        missing = [str(p) for p in layers if not p.is_file()]
        if missing:
            raise SystemExit(f"oci.py image: no such layer: {', '.join(missing)} (rebuild: e2e/cluster/images.sh)")
        digest = make_image(name, config, layers, a.out)
        print(digest, file=sys.stderr if str(a.out) == "-" else sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
