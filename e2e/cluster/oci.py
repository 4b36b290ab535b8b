"""OCI images written by our own code (no registry, no image builder). A layer is a directory tree kept
in the cache with a descriptor beside it (the digest and size of the tree's tar, the globs left out); an
image is a recipe naming its layers, and `image` writes the OCI image layout that `ctr image import`
reads, tarring each layer's tree as it goes. No layer tarball is kept on disk: the torch layer's tree
is hard links into the venv, and a 4 GB tar of it beside every node's unpacked copy was the suite's
largest use of disk.

    python3 oci.py layer SRC_DIR OUT.json [--exclude GLOB ...]   # measures the tree's tar; prints its digest
    python3 oci.py image --recipe IMAGE.json --out - | ctr -n k8s.io image import -   # streamed
    python3 oci.py image --name REF --config CONFIG.json --layer A.json [--layer B.json ...] --out IMAGE.tar

A tree's tar is the same bytes every time (sorted, numeric owners, the files' own modes and times), so
the digest measured once holds while the tree is untouched; `image` checks it again as it streams and
fails naming the layer if the tree changed. Layers stay uncompressed: containerd takes them as they
are, and gzip of the torch layer would cost minutes on a 2-core machine for no gain on one host."""
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
    """A write-only file that hashes and counts what passes through to the real file (or nowhere)."""

    def __init__(self, f=None):
        self.f, self.h, self.n = f, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.h.update(b)
        self.n += len(b)
        return self.f.write(b) if self.f is not None else len(b)

    @property
    def digest(self) -> str:
        return f"sha256:{self.h.hexdigest()}"


def write_tree(src: Path, exclude: list[str], out) -> None:
    """SRC's tree as an uncompressed tar into the binary file OUT: sorted, numeric owners, hard links
    kept, paths matching an EXCLUDE glob (relative to SRC) left out with their subtrees."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
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


def measure_layer(src: Path, out: Path, exclude: list[str]) -> dict:
    """Write OUT, the descriptor of the layer SRC's tree makes: its directory, excludes, digest, size."""
    if not src.is_dir():
        raise SystemExit(f"oci.py layer: {src} is not a directory")
    sink = _Hashing()
    write_tree(src, exclude, sink)
    layer = {"dir": str(src.resolve()), "exclude": exclude, "digest": sink.digest, "size": sink.n}
    tmp = out.with_suffix(out.suffix + ".part")
    tmp.write_text(json.dumps(layer, indent=1))
    tmp.rename(out)
    return layer


def _load_layer(path: Path) -> dict:
    try:
        layer = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"oci.py image: layer {path}: {e} (rebuild: e2e/cluster/images.sh)") from None
    if not Path(layer.get("dir", "")).is_dir():
        raise SystemExit(f"oci.py image: layer {path}: its tree {layer.get('dir')!r} is gone "
                         "(rebuild: e2e/cluster/images.sh)")
    return layer


def _descriptor(mt: str, blob_digest: str, size: int, **extra) -> dict:
    return {"mediaType": mt, "digest": blob_digest, "size": size, **extra}


def _member(out, name: str, size: int) -> None:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode = size, 0o644
    out.write(ti.tobuf(tarfile.PAX_FORMAT))


def _pad(out, size: int) -> None:
    out.write(b"\0" * (-size % tarfile.BLOCKSIZE))


def make_image(name: str, config: dict, layer_files: list[Path], out) -> str:
    """Write an OCI image layout tarball holding one image named NAME to the binary file OUT, the
    layers' tars made from their trees on the way; return the manifest digest."""
    if ":" not in name.rsplit("/", 1)[-1]:
        raise SystemExit(f"oci.py image: --name {name!r} needs a tag (repository:tag)")
    for key in ("architecture", "os", "config"):
        if key not in config:
            raise SystemExit(f"oci.py image: the config has no {key!r}")
    layers = [_load_layer(p) for p in layer_files]
    cfg = {**config, "rootfs": {"type": "layers", "diff_ids": [x["digest"] for x in layers]}}
    cfg_blob = json.dumps(cfg, sort_keys=True).encode()
    cfg_digest = "sha256:" + hashlib.sha256(cfg_blob).hexdigest()
    manifest = {"schemaVersion": 2, "mediaType": MT_MANIFEST,
                "config": _descriptor(MT_CONFIG, cfg_digest, len(cfg_blob)),
                "layers": [_descriptor(MT_LAYER, x["digest"], x["size"]) for x in layers]}
    man_blob = json.dumps(manifest, sort_keys=True).encode()
    man_digest = "sha256:" + hashlib.sha256(man_blob).hexdigest()
    index = {"schemaVersion": 2, "mediaType": MT_INDEX, "manifests": [_descriptor(
        MT_MANIFEST, man_digest, len(man_blob),
        # containerd names the image from the first; other tools read the OCI tag.
        annotations={"io.containerd.image.name": name,
                     "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]})]}

    for arc, data in (("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode()),
                      ("index.json", json.dumps(index, sort_keys=True).encode()),
                      (f"blobs/sha256/{man_digest[7:]}", man_blob), (f"blobs/sha256/{cfg_digest[7:]}", cfg_blob)):
        _member(out, arc, len(data))
        out.write(data)
        _pad(out, len(data))
    seen = set()
    for layer, path in zip(layers, layer_files):
        if layer["digest"] in seen:
            continue
        seen.add(layer["digest"])
        _member(out, f"blobs/sha256/{layer['digest'][7:]}", layer["size"])
        sink = _Hashing(out)
        write_tree(Path(layer["dir"]), layer["exclude"], sink)
        if (sink.digest, sink.n) != (layer["digest"], layer["size"]):
            raise SystemExit(f"oci.py image: the tree of layer {path} changed since it was measured "
                             f"({sink.digest}, {sink.n} bytes; measured {layer['digest']}, {layer['size']}): "
                             "rebuild it (e2e/cluster/images.sh)")
        _pad(out, layer["size"])
    out.write(b"\0" * (2 * tarfile.BLOCKSIZE))
    return man_digest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="oci.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("layer", help="measure a directory's tar: the layer descriptor")
    lp.add_argument("src", type=Path)
    lp.add_argument("out", type=Path, help="the descriptor (JSON) to write")
    lp.add_argument("--exclude", action="append", default=[], help="glob of paths relative to SRC to leave out")
    ip = sub.add_parser("image", help="write an OCI image layout tarball")
    ip.add_argument("--name", help="full reference, e.g. pdrollout.local/engine-cpu:0.1.0")
    ip.add_argument("--config", type=Path, help="image config JSON (architecture, os, config)")
    ip.add_argument("--layer", action="append", type=Path, default=[], help="layer descriptor, base first")
    ip.add_argument("--recipe", type=Path, help='JSON {"name", "config", "layers"} instead of the three above')
    ip.add_argument("--out", required=True, help="the image tarball, or - for stdout")
    a = ap.parse_args(argv)
    if a.cmd == "layer":
        print(measure_layer(a.src, a.out, a.exclude)["digest"])
        return
    if a.recipe:
        r = json.loads(a.recipe.read_text())
        name, config, layers = r["name"], r["config"], [Path(p) for p in r["layers"]]
    elif a.name and a.config and a.layer:
        name, config, layers = a.name, json.loads(a.config.read_text()), a.layer
    else:
        raise SystemExit("oci.py image: give --recipe, or --name, --config and --layer")
    if a.out == "-":
        digest = make_image(name, config, layers, sys.stdout.buffer)
        sys.stdout.buffer.flush()
        print(digest, file=sys.stderr)
    else:
        tmp = Path(a.out + ".part")
        with open(tmp, "wb") as f:
            digest = make_image(name, config, layers, f)
        tmp.rename(a.out)
        print(digest)


if __name__ == "__main__":
    sys.exit(main())
