"""e2e/cluster/oci.py, the real-node images' writer: a layer is measured once from its tree and tarred
again as an image streams; the two must be the same bytes, and a tree changed in between is refused."""
from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("oci", Path(__file__).parents[1] / "e2e/cluster/oci.py")
oci = importlib.util.module_from_spec(spec)
spec.loader.exec_module(oci)


def tree(root: Path) -> Path:
    (root / "lib/pkg").mkdir(parents=True)
    (root / "lib/pkg/a.py").write_text("x = 1\n")
    os.link(root / "lib/pkg/a.py", root / "lib/pkg/b.py")
    (root / "lib/pkg/c").symlink_to("a.py")
    (root / "dev").mkdir()
    (root / "dev/null-ish").write_text("left out")
    return root


def image(tmp_path: Path, layer: Path) -> tarfile.TarFile:
    buf = io.BytesIO()
    oci.make_image("pdrollout.local/t:1", {"architecture": "amd64", "os": "linux", "config": {}}, [layer], buf)
    return tarfile.open(fileobj=io.BytesIO(buf.getvalue()))


def test_the_streamed_layer_is_the_measured_one(tmp_path):
    desc = oci.measure_layer(tree(tmp_path / "t"), tmp_path / "t.json", ["dev/*"])
    img = image(tmp_path, tmp_path / "t.json")
    blob = img.extractfile(f"blobs/sha256/{desc['digest'][7:]}").read()
    assert (f"sha256:{hashlib.sha256(blob).hexdigest()}", len(blob)) == (desc["digest"], desc["size"])
    members = {m.name: m for m in tarfile.open(fileobj=io.BytesIO(blob))}
    assert "dev" in members and "dev/null-ish" not in members
    assert members["lib/pkg/b.py"].islnk() and members["lib/pkg/b.py"].linkname == "lib/pkg/a.py"
    assert members["lib/pkg/c"].issym() and members["lib/pkg/a.py"].uname == ""
    index = json.loads(img.extractfile("index.json").read())
    manifest = json.loads(img.extractfile("blobs/sha256/" + index["manifests"][0]["digest"][7:]).read())
    assert manifest["layers"] == [{"mediaType": oci.MT_LAYER, "digest": desc["digest"], "size": desc["size"]}]
    assert index["manifests"][0]["annotations"]["io.containerd.image.name"] == "pdrollout.local/t:1"


def test_a_tree_changed_after_measuring_is_refused_naming_the_layer(tmp_path):
    oci.measure_layer(tree(tmp_path / "t"), tmp_path / "t.json", [])
    (tmp_path / "t/lib/pkg/a.py").write_text("x = 2\n")
    with pytest.raises(SystemExit, match=r"the tree of layer .*t\.json changed since it was measured"):
        image(tmp_path, tmp_path / "t.json")


def test_a_layer_whose_tree_is_gone_is_refused(tmp_path):
    oci.measure_layer(tree(tmp_path / "t"), tmp_path / "t.json", [])
    os.rename(tmp_path / "t", tmp_path / "u")
    with pytest.raises(SystemExit, match="its tree .* is gone"):
        image(tmp_path, tmp_path / "t.json")
