"""Issue 63, Must show 1: SGLang's own `init_custom_process_group`, imported from the released package
in the RL clients' side venv (tests/rl_clients.py), forms a gloo weights update group with a
`pdrollout serve` started as the operator starts it (mode pd, an admin token, the trainer's address
in --admin-peers, the engine config as a file), and a trainer process pushes every parameter of a
second checkpoint through /update_weights_from_distributed in slime's buckets and order (pause,
GET /flush_cache, the buckets with weight_version, continue: tests/rl_trainer.py names slime's
files). Greedy outputs then equal a fresh server's on the pushed checkpoint.

Before the engine formed its side with SGLang's helper path (rendezvous, PrefixStore(group_name),
torch's group helper) this test failed: the trainer waited on the keys under `G/G/` and the engine
wrote them under `G/`, and the init answered 400 DistNetworkError after the timeout."""
from __future__ import annotations

import json

import httpx
import pytest
from safetensors.torch import load_file

import rl_clients
from rl_common import ENGINE, checkpoint
from serverproc import ServerProcess

pytestmark = pytest.mark.timeout(900)
TRAINER_ADDR = "127.0.0.2"
TOKEN = "operator-admin-token"
PROMPTS = [[3, 5, 7, 9, 11], list(range(20, 38)), [401, 17, 99]]
SP = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def greedy(http) -> list[list[int]]:
    r = http.post("/generate", json={"input_ids": PROMPTS, "sampling_params": SP})
    assert r.status_code == 200, r.text
    return [b["output_ids"] for b in r.json()]


def test_sglang_helper_forms_the_group_and_slime_pushes_every_parameter(tmp_path):
    s0, s1 = checkpoint(tmp_path / "s0", 0), checkpoint(tmp_path / "s1", 1)
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "engine.json").write_text(ENGINE)
    operator_args = ["--mode", "pd", "--engine-config", str(tmp_path / "engine.json"), "--drain-timeout", "30",
                     "--admin-token-file", str(tmp_path / "token"), "--admin-peers", f"{TRAINER_ADDR}/32"]
    fresh = ServerProcess(s1, *operator_args)
    try:
        ref1 = greedy(fresh.http)
    finally:
        assert fresh.stop() == 0, fresh.log[-3000:]
    s = ServerProcess(s0, *operator_args)
    slime = httpx.Client(base_url=s.url, timeout=300, transport=httpx.HTTPTransport(local_address=TRAINER_ADDR))
    try:
        assert greedy(slime) != ref1
        # slime's UpdateWeightFromDistributed.update_weights: pause, flush, send, continue
        assert slime.post("/pause_generation", json={}).status_code == 200
        assert slime.get("/flush_cache").status_code == 200
        r = rl_clients.run("rl_trainer.py", "--url", s.url, "--model", s1, "--engine-ranks", "1", "--version", "1",
                           "--flush-cache", "false", "--bucket-bytes", str(256 << 10), "--source", TRAINER_ADDR,
                           "--steps", "init,update")
        assert r.returncode == 0, r.stderr[-3000:] + s.log[-3000:]
        lines = [json.loads(x) for x in r.stdout.splitlines()]
        assert lines[0]["init"]["status"] == 200 and lines[0]["init"]["body"]["success"], (lines[0], s.log[-3000:])
        updates = [x for x in lines if "update" in x]
        assert all(u["update"]["status"] == 200 and u["update"]["body"]["success"] for u in updates), updates
        # every parameter went, in more than one bucket of each kind
        assert sum(u["tensors"] for u in updates) == len(load_file(f"{s1}/model.safetensors")) and len(updates) > 2
        assert slime.post("/continue_generation", json={}).status_code == 200
        assert greedy(slime) == ref1
        assert slime.get("/get_weight_version").json() == {"weight_version": "1"}
        r = slime.post("/destroy_weights_update_group", json={"group_name": "slime-pp_0"})
        assert r.status_code == 200 and r.json()["success"], r.text
    finally:
        slime.close()
        assert s.stop() == 0, s.log[-3000:]


def test_skyrl_pushes_one_tensor_a_request(tmp_path):
    """SkyRL's remote SGLang engine: its init body, one tensor per /update_weights_from_distributed in SGLang's
    earlier singular fields (name, dtype, shape), destroy with no body (the default group name)."""
    s0, s1 = checkpoint(tmp_path / "s0", 0), checkpoint(tmp_path / "s1", 1)
    fresh = ServerProcess(s1, "--engine-config", ENGINE)
    try:
        ref1 = greedy(fresh.http)
    finally:
        assert fresh.stop() == 0, fresh.log[-3000:]
    s = ServerProcess(s0, "--engine-config", ENGINE)
    try:
        r = rl_clients.run("rl_trainer.py", "--url", s.url, "--model", s1, "--engine-ranks", "1", "--skyrl",
                           "--group", "weight_update_group")
        assert r.returncode == 0, r.stderr[-3000:] + s.log[-3000:]
        lines = [json.loads(x) for x in r.stdout.splitlines()]
        answers = [x[k] for x in lines for k in ("init", "update", "destroy") if k in x]
        assert len(answers) == 2 + len(load_file(f"{s1}/model.safetensors"))
        assert all(a["status"] == 200 and a["body"]["success"] for a in answers), answers
        assert greedy(s.http) == ref1
        bad = s.http.post("/update_weights_from_distributed", json={"name": "model.norm.weight", "dtype": "float32"})
        assert bad.status_code == 400 and "give name, dtype and shape together" in bad.text, bad.text
    finally:
        assert s.stop() == 0, s.log[-3000:]
