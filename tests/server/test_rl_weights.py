"""Issue 18, Must-show 1, 3 (CPU mechanics) and routing replay: real `pdrollout serve` processes on
one rank and on 4 ranks (ATP2/ADP2), real HTTP, a real trainer process (tests/rl_trainer.py: SGLang's helper forms the group).

After /update_weights_from_distributed (a trainer holding the second checkpoint) and
/update_weights_from_disk, greedy outputs equal a fresh engine started on that checkpoint; bad
updates are refused with a clear message and change nothing; memory release/resume gives the
tensors back and the outputs after resume equal those before; return_routed_experts equals
transformers' router on one rank and one rank's ids on four."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

import rl_clients
from rl_common import ENGINE, checkpoint
from serverproc import ServerProcess
from pdrollout.engine.model.checkpoint import write_checkpoint
from pdrollout.engine.protocol.config import load_preset

pytestmark = pytest.mark.timeout(900)
TOPOLOGIES = {"1rank": [], "4ranks-atp2-adp2": ["--nproc", "4", "--adp", "2", "--ep", "4"]}
PROMPTS = [[3, 5, 7, 9, 11], list(range(20, 38)), [401, 17, 99]]
SP = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("rl")
    other = load_preset("tiny")
    other["num_hidden_layers"] += 1
    return {"s0": checkpoint(d / "s0", 0), "s1": checkpoint(d / "s1", 1),
            "other": str(write_checkpoint(other, d / "other", seed=2))}


def greedy(s: ServerProcess, **extra) -> list[dict]:
    r = s.http.post("/generate", json={"input_ids": PROMPTS, "sampling_params": SP, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def ids(bodies) -> list[list[int]]:
    return [b["output_ids"] for b in bodies]


def trainer(url: str, model: str, ranks: int, version: str) -> list[dict]:
    r = rl_clients.run("rl_trainer.py", "--url", url, "--model", model, "--engine-ranks", str(ranks),
                       "--version", version, "--bucket-bytes", str(256 << 10), timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert lines[-1] == {"done": True}
    return lines


@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_weight_updates_equal_a_fresh_engine(ckpts, topo):
    args = [*TOPOLOGIES[topo], "--engine-config", ENGINE, "--enable-memory-saver"]
    ranks = 4 if topo.startswith("4") else 1
    fresh = ServerProcess(ckpts["s1"], *args)
    try:
        ref1 = ids(greedy(fresh))
    finally:
        assert fresh.stop() == 0, fresh.log[-3000:]
    s = ServerProcess(ckpts["s0"], *args)
    try:
        ref0 = ids(greedy(s))            # a fresh engine on the first checkpoint
        assert ref0 != ref1
        assert s.http.get("/get_weight_version").json() == {"weight_version": "default"}

        # a trainer process holding the second checkpoint pushes it through an update group
        lines = trainer(s.url, ckpts["s1"], ranks, "step-1")
        assert lines[0]["init"]["status"] == 200 and lines[0]["init"]["body"]["success"], lines[0]
        updates = [x["update"] for x in lines if "update" in x]
        assert len(updates) > 1 and all(u["status"] == 200 and u["body"]["success"] for u in updates)
        assert lines[-2]["destroy"]["body"]["success"]
        after = greedy(s)
        assert ids(after) == ref1
        assert all(b["meta_info"]["weight_versions"] == [{"version": "step-1", "start": 0, "end": 8}] for b in after)
        assert s.http.get("/get_weight_version").json() == {"weight_version": "step-1"}

        # from disk, back to the first checkpoint, then to the second again
        r = s.http.post("/update_weights_from_disk", json={"model_path": ckpts["s0"], "weight_version": "d0"})
        assert r.status_code == 200 and r.json()["success"] and r.json()["num_paused_requests"] == 0, r.text
        assert ids(greedy(s)) == ref0
        r = s.http.post("/update_weights_from_disk", json={"model_path": ckpts["s1"], "weight_version": "d1"})
        assert r.status_code == 200, r.text
        out = greedy(s)
        assert ids(out) == ref1 and out[0]["meta_info"]["weight_version"] == "d1"
        info = s.http.get("/model_info").json()
        assert info["weight_version"] == "d1" and info["model_path"] == ckpts["s1"]

        # refused updates change nothing and the server keeps serving
        for body, status, words in (
                ({"model_path": "/nonexistent"}, 400, "config.json not found"),
                ({"model_path": ckpts["other"]}, 400, "different architecture: num_hidden_layers differ"),
                ({"model_path": ckpts["s0"], "is_async": True}, 400, "is_async=True is not supported")):
            r = s.http.post("/update_weights_from_disk", json=body)
            assert r.status_code == status and words in r.text, r.text
        for body, words in (
                ({"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}, "no weights update group"),
                ({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 1 + ranks},
                 "backend nccl needs an engine on CUDA devices")):
            path = "/update_weights_from_distributed" if "names" in body else "/init_weights_update_group"
            r = s.http.post(path, json=body)
            assert r.status_code == 400 and r.json()["success"] is False and words in r.json()["message"], r.text
        assert ids(greedy(s)) == ref1 and s.http.get("/get_weight_version").json()["weight_version"] == "d1"

        # release and resume: the tensors are given back, requests are refused meanwhile, and the
        # outputs after resume equal those before
        mem = s.http.get("/get_server_info").json()["memory"]
        assert mem["bytes"]["weights"] > 0 and mem["bytes"]["kv_cache"] > 0 and mem["released"] == []
        assert s.http.post("/release_memory_occupation", json={"tags": ["vram"]}).status_code == 400
        r = s.http.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]})
        assert r.status_code == 200 and r.json() is None
        mem = s.http.get("/get_server_info").json()["memory"]
        assert mem["bytes"] == {"weights": 0, "kv_cache": 0} and mem["released"] == ["kv_cache", "weights"]
        r = s.http.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": SP})
        assert r.status_code == 400 and "memory is released" in r.text
        assert s.http.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
        assert s.http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
        assert s.http.get("/get_server_info").json()["memory"]["bytes"]["weights"] > 0
        assert ids(greedy(s)) == ref1
    finally:
        assert s.stop() == 0, s.log[-3000:]


def _routes(body, layers: int, k: int) -> np.ndarray:
    raw = base64.b64decode(body["meta_info"]["routed_experts"])
    return np.frombuffer(raw, dtype=np.int32).reshape(-1, layers, k)


def test_routed_experts_equal_transformers_router_and_one_rank_on_four(ckpts):
    from hf_reference import hf_model
    cfg = load_preset("tiny")
    layers, k = cfg["num_hidden_layers"], cfg["num_experts_per_tok"]
    got = {}
    for topo, args in TOPOLOGIES.items():
        s = ServerProcess(ckpts["s0"], *args, "--engine-config", ENGINE)
        try:
            got[topo] = greedy(s, return_routed_experts=True)
            late = greedy(s, return_routed_experts=True, routed_experts_start_len=3)
        finally:
            assert s.stop() == 0, s.log[-3000:]
        for p, b, b3 in zip(PROMPTS, got[topo], late):
            r = _routes(b, layers, k)
            assert r.shape == (len(p) + 8 - 1, layers, k)      # every position fed: prompt + output - 1
            assert (_routes(b3, layers, k) == r[3:]).all()
    # transformers' router over the same sequence: the same top-k set per layer and position
    m = hf_model(ckpts["s0"])
    for p, b in zip(PROMPTS, got["1rank"]):
        seq = torch.tensor([p + b["output_ids"][:-1]])
        with torch.no_grad():
            out = m(seq, output_router_logits=True)
        ours = _routes(b, layers, k)
        for layer, logits in enumerate(out.router_logits):
            ref = torch.topk(logits.float(), k, dim=-1).indices.numpy()
            assert (np.sort(ours[:, layer], -1) == np.sort(ref, -1)).all(), f"layer {layer}"
    for a, b in zip(got["1rank"], got["4ranks-atp2-adp2"]):
        assert (_routes(a, layers, k) == _routes(b, layers, k)).all() and a["output_ids"] == b["output_ids"]


@pytest.mark.parametrize("proposer,ranks", [("draft", []), ("mtp", TOPOLOGIES["4ranks-atp2-adp2"])],
                         ids=["draft-1rank", "mtp-4ranks-atp2-adp2"])
def test_release_gives_back_what_speculation_holds(tmp_path, proposer, ranks):
    """Under speculation rank 0 holds more than its target shard: the proposers' KV caches, and the
    draft model, or (on several ranks) an unsharded MTP head. A release gives all of it back (an RL
    loop hands the GPU to the trainer), and the outputs after resume equal those before."""
    cfg = load_preset("tiny")
    model = write_checkpoint({**cfg, "num_nextn_predict_layers": 1} if proposer == "mtp" else cfg,
                             tmp_path / "target", seed=0)
    spec = ["--speculative", proposer, "--speculative-k", "2"]
    if proposer == "draft":
        spec += ["--draft-model", str(write_checkpoint({**cfg, "num_hidden_layers": 1}, tmp_path / "draft", seed=3))]
    plain = ServerProcess(model, "--engine-config", ENGINE, *ranks)
    try:
        target = plain.http.get("/get_server_info").json()["memory"]["bytes"]
    finally:
        assert plain.stop() == 0, plain.log[-3000:]
    s = ServerProcess(model, "--engine-config", ENGINE, "--enable-memory-saver", *spec, *ranks)
    try:
        before = ids(greedy(s))
        held = s.http.get("/get_server_info").json()["memory"]["bytes"]
        # the report counts what speculation holds beside the target: more weights, more KV
        assert held["weights"] > target["weights"] and held["kv_cache"] > target["kv_cache"], (held, target)
        assert s.http.post("/release_memory_occupation", json={"tags": None}).status_code == 200
        mem = s.http.get("/get_server_info").json()["memory"]
        assert mem["bytes"] == {"weights": 0, "kv_cache": 0}, (held, mem)
        assert s.http.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
        assert s.http.post("/resume_memory_occupation", json={"tags": None}).status_code == 200
        assert s.http.get("/get_server_info").json()["memory"]["bytes"] == held
        bodies = greedy(s)
        assert ids(bodies) == before
        assert sum(b["meta_info"]["spec_proposed_drafts"] for b in bodies) > 0   # the proposers run again
    finally:
        assert s.stop() == 0, s.log[-3000:]
