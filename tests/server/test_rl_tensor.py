"""Issue 49, Must-show 3 (CPU): POST /update_weights_from_tensor from a real trainer process
(tests/rl_tensor_trainer.py) into real `pdrollout serve` processes, one rank and 4 ranks
(ATP2/ADP2/EP4): after the update the greedy tokens are a fresh engine's on the new checkpoint,
in SGLang's flattened-bucket format (one entry for all ranks) and its plain (name, tensor) list
(one entry per rank), CPU tensors by value. Bodies that are not the expected structure, or a pickle that would run code,
get a 400 naming what is wrong, change nothing and run nothing."""
from __future__ import annotations

import base64
import io
import json
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from rl_common import ENGINE, checkpoint
from serverproc import ServerProcess
from pdrollout.engine.runtime.tensor_payload import flattened_bucket

pytestmark = pytest.mark.timeout(900)
TENSOR_TRAINER = str(Path(__file__).resolve().parent.parent / "rl_tensor_trainer.py")
TOPOLOGIES = {"1rank": [], "4ranks-atp2-adp2": ["--nproc", "4", "--adp", "2", "--ep", "4"]}
PROMPTS = [[3, 5, 7, 9, 11], list(range(20, 38)), [401, 17, 99]]
SP = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("rl-tensor")
    return {"s0": checkpoint(d / "s0", 0), "s1": checkpoint(d / "s1", 1)}


def greedy(s: ServerProcess) -> list[list[int]]:
    r = s.http.post("/generate", json={"input_ids": PROMPTS, "sampling_params": SP})
    assert r.status_code == 200, r.text
    return [b["output_ids"] for b in r.json()]


def push(url: str, model: str, *args: str) -> list[dict]:
    r = subprocess.run([sys.executable, TENSOR_TRAINER, "--url", url, "--model", model, *args],
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert lines[-1] == {"done": True}
    updates = [x["update"] for x in lines[:-1]]
    assert len(updates) > 1 and all(u["status"] == 200 and u["body"]["success"] for u in updates), updates
    return updates


class _RunsCode:
    """A pickle that would run a shell command when loaded."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def _b64(obj) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_update_from_tensor_equals_a_fresh_engine(ckpts, topo, tmp_path):
    args = [*TOPOLOGIES[topo], "--engine-config", ENGINE]
    ranks = 4 if topo.startswith("4") else 1
    fresh = ServerProcess(ckpts["s1"], *args)
    try:
        ref1 = greedy(fresh)
    finally:
        assert fresh.stop() == 0, fresh.log[-3000:]
    s = ServerProcess(ckpts["s0"], *args)
    try:
        ref0 = greedy(s)
        assert ref0 != ref1

        # slime's colocated path: flattened buckets, one entry for all ranks
        push(s.url, ckpts["s1"], "--format", "flattened_bucket", "--version", "t1")
        r = s.http.post("/generate", json={"input_ids": PROMPTS, "sampling_params": SP})
        assert [b["output_ids"] for b in r.json()] == ref1
        assert all(b["meta_info"]["weight_versions"] == [{"version": "t1", "start": 0, "end": 8}] for b in r.json())
        assert s.http.get("/get_weight_version").json() == {"weight_version": "t1"}

        # (name, tensor) pairs, one entry per rank as SGLang indexes them by TP rank
        push(s.url, ckpts["s0"], "--format", "direct", "--entries", str(ranks),
             "--version", "t0")
        assert greedy(s) == ref0

        # refused: a 400 that names what is wrong, nothing changes, the server keeps serving
        marker = tmp_path / "ran"
        norm = ("model.norm.weight", torch.ones(64))
        bad = [
            ({"serialized_named_tensors": [_b64(_RunsCode(str(marker)))]}, "refused to unpickle posix.system"),
            ({"serialized_named_tensors": ["%%not base64"]}, "serialized_named_tensors[0] is not valid base64"),
            ({"serialized_named_tensors": [_b64({"a": 1})]}, "needs a list of (name, tensor) pairs"),
            ({"serialized_named_tensors": [_b64([("model.nope.weight", torch.ones(2))])]},
             "unexpected tensor 'model.nope.weight'"),
            ({"serialized_named_tensors": [_b64([("model.norm.weight", torch.ones(3))])]},
             "tensor 'model.norm.weight' has shape (3,), model expects (64,)"),
            ({"serialized_named_tensors": [_b64([norm, norm])]}, "names a tensor twice"),
            ({"serialized_named_tensors": [_b64([norm])], "load_format": "flattened_bucket"},
             "'flattened_bucket' needs a dict with keys flattened_tensor and metadata"),
            ({"serialized_named_tensors": [_b64([norm])] * (ranks + 1)},
             f"has {ranks + 1} entries: give one for all ranks or one per rank ({ranks})"),
            ({"serialized_named_tensors": [_b64([norm])], "load_format": "npz"}, "load_format"),
            ({"serialized_named_tensors": []}, "serialized_named_tensors"),
            ({"serialized_named_tensors": [7]}, "serialized_named_tensors.0"),
        ]
        for body, words in bad:
            r = s.http.post("/update_weights_from_tensor", json=body)
            assert r.status_code == 400 and words in r.text, (body, r.text)
        assert not marker.exists(), "the refused pickle ran its code"
        assert greedy(s) == ref0 and s.http.get("/get_weight_version").json()["weight_version"] == "t0"

        # a flattened bucket whose ranges do not fit its tensor is refused before any rank writes
        bucket = flattened_bucket([("model.norm.weight", torch.zeros(64)), ("lm_head.weight", torch.zeros(3))])
        r = s.http.post("/update_weights_from_tensor", json={"serialized_named_tensors": [_b64(bucket)],
                                                            "load_format": "flattened_bucket"})
        assert r.status_code == 400 and "tensor 'lm_head.weight' has shape (3,)" in r.text, r.text
        assert greedy(s) == ref0
    finally:
        assert s.stop() == 0, s.log[-3000:]


def test_restricted_unpickler_reads_what_sglang_writes(monkeypatch):
    """A flattened bucket reads back exactly; SGLang's
    record classes under SGLang's module path (what verl pickles: a LocalSerializedTensor with one
    pickle per rank) map onto ours; a CPU tensor in shared memory (what torch's multiprocessing pickle makes of one) gets the advice
    it needs."""
    from multiprocessing.reduction import ForkingPickler
    from pdrollout.engine.runtime import tensor_payload as tp
    named = [("a", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)), ("b", torch.ones(4))]
    got = tp.load_entry(_b64(flattened_bucket(named)), "flattened_bucket", 0, "e")
    assert [n for n, _ in got] == ["a", "b"] and all(torch.equal(x, y) for (_, x), (_, y) in zip(got, named))
    assert got[0][1].dtype == torch.bfloat16

    class LocalSerializedTensor:   # pickled under SGLang's name, as sglang itself would write it
        def __init__(self, values):
            self.values = values
    mod = types.ModuleType("sglang.srt.model_executor.model_runner")
    mod.LocalSerializedTensor = LocalSerializedTensor
    LocalSerializedTensor.__module__, LocalSerializedTensor.__qualname__ = mod.__name__, "LocalSerializedTensor"
    for i, part in enumerate(parts := mod.__name__.split(".")):   # the package chain pickle imports
        name = ".".join(parts[:i + 1])
        monkeypatch.setitem(sys.modules, name, mod if name == mod.__name__ else types.ModuleType(name))
    per_rank = [pickle.dumps(named[0][1] * (r + 1)) for r in range(2)]
    raw = pickle.dumps([("a", LocalSerializedTensor(per_rank))])
    assert b"sglang.srt.model_executor.model_runner" in raw
    monkeypatch.undo()   # sglang is not importable again, as on the server
    got = tp.load_entry(base64.b64encode(raw).decode(), None, 1, "e")
    assert torch.equal(got[0][1], named[0][1] * 2)   # rank 1 took its own value

    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"   # torch's default on Linux
    buf = io.BytesIO()
    ForkingPickler(buf).dump([("a", torch.ones(3))])
    with pytest.raises(tp.PayloadError, match=r"send CPU tensors by value \(pickle.dumps, base64\)"):
        tp.load_entry(base64.b64encode(buf.getvalue()).decode(), None, 0, "e")
