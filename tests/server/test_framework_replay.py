"""Issue 49, Must show 1: each framework's call sequence (tests/rl_framework_calls.py: slime, AReaL, verl)
replayed against a server started as the operator starts it: an admin token configured, the framework's
address in --admin-peers, and no Authorization header sent, as the frameworks send none. Every call
succeeds and every field the framework reads is there with the type it expects; the weights update group
is formed and fed by a real trainer process from the framework's address; on 1 rank and on 4."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import rl_clients
from rl_common import ENGINE, checkpoint
from rl_framework_calls import CALLS, REFUSED, SLIME_SERVER_CHECK, TENSORS, TRAINER
from serverproc import ServerProcess

pytestmark = pytest.mark.timeout(1200)
TOPOLOGIES = {"1rank": [], "4ranks-atp2-adp2": ["--nproc", "4", "--adp", "2", "--ep", "4"]}
FRAMEWORK_ADDR = "127.0.0.2"
TOKEN = "operator-admin-token"
PROMPT = [3, 5, 7, 9, 11, 13]


def fill(value, subs: dict):
    if isinstance(value, str) and value in subs:
        return subs[value]
    if isinstance(value, dict):
        return {k: fill(v, subs) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, subs) for v in value]
    return value


def field(body, path: str):
    for part in path.split("."):
        assert isinstance(body, dict) and part in body, f"missing {path!r} in {json.dumps(body)[:400]}"
        body = body[part]
    return body


def last_event(text: str) -> dict:
    events = [json.loads(x[6:]) for x in text.splitlines() if x.startswith("data: {")]
    assert events and text.rstrip().endswith("data: [DONE]"), text[-300:]
    return events[-1]


TENSOR_TRAINER = str(Path(__file__).resolve().parent.parent / "rl_tensor_trainer.py")


def push_tensors(url: str, model: str, ranks: int, fmt: dict) -> list[dict]:
    entries = ranks if fmt["entries"] == "per-rank" else 1
    r = subprocess.run([sys.executable, TENSOR_TRAINER, "--url", url, "--model", model, "--format", fmt["format"],
                        "--entries", str(entries), "--source", FRAMEWORK_ADDR], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(x)["update"] for x in r.stdout.splitlines() if '"update"' in x]


def greedy(http: httpx.Client) -> list[int]:
    r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                              "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def push_weights(url: str, model: str, ranks: int, init_extra: dict) -> list[dict]:
    r = rl_clients.run("rl_trainer.py", "--url", url, "--model", model, "--engine-ranks", str(ranks),
                       "--version", "trainer-step", "--bucket-bytes", str(256 << 10), "--source", FRAMEWORK_ADDR,
                       "--init-extra", json.dumps(init_extra), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(x) for x in r.stdout.splitlines()]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("replay")
    return {"s0": checkpoint(d / "s0", 0), "s1": checkpoint(d / "s1", 1)}


@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_frameworks_drive_the_server_unchanged(ckpts, topo, tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    ranks = 4 if topo.startswith("4") else 1
    s = ServerProcess(ckpts["s0"], *TOPOLOGIES[topo], "--engine-config", ENGINE, "--admin-token-file", str(token),
                      "--admin-peers", f"{FRAMEWORK_ADDR}/32",
                      "--enable-memory-saver")   # slime's --offload-rollout, verl's default
    framework = httpx.Client(base_url=s.url, timeout=300, transport=httpx.HTTPTransport(local_address=FRAMEWORK_ADDR))
    try:
        s0_tokens = greedy(framework)
        first = framework.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}).json()
        subs = {"{prompt}": PROMPT, "{model}": ckpts["s1"], "{partial}": PROMPT + first["output_ids"]}
        for name, calls in CALLS.items():
            at_start = greedy(framework)
            for method, path, body, reads, *headers in calls:
                where = f"{name}: {method} {path} {json.dumps(body)[:120]}"
                if method == TRAINER:
                    lines = push_weights(s.url, ckpts["s1"], ranks, body)
                    answers = [x for line in lines for k, x in line.items() if k in ("init", "update", "destroy")]
                    assert len(answers) >= 3 and all(a["status"] == 200 and a["body"]["success"] for a in answers), \
                        (where, answers)
                    continue
                if method == TENSORS:   # this trainer holds s0: the weights go back to it
                    answers = push_tensors(s.url, ckpts["s0"], ranks, body)
                    assert len(answers) > 1 and all(a["status"] == 200 and a["body"]["success"] for a in answers), \
                        (where, answers)
                    continue
                r = framework.request(method, path, headers=headers[0] if headers else None,
                                      **({} if body is None else {"json": fill(body, subs)}))
                assert r.status_code == 200, (where, r.status_code, r.text[:500])
                out = last_event(r.text) if (body or {}).get("stream") else r.json()
                for path_read, kind in (reads or {}).items():
                    assert isinstance(field(out, path_read), kind), (where, path_read, kind)
                if path.startswith("/v1/loads"):
                    assert out["dp_rank_count"] == (2 if ranks == 4 else 1) and \
                        all(isinstance(x["num_running_reqs"], int) for x in out["loads"])
            assert not s.http.get("/get_server_info").json()["paused"], name
            if any(c[0] == TENSORS for c in calls):   # the tensors changed the greedy tokens to s0's exactly
                assert greedy(framework) == s0_tokens != at_start, name
        # what a stranger may not do, after all of it: the peer rule admitted only the framework
        assert s.http.post("/pause_generation", json={}).status_code == 401
    finally:
        framework.close()
        assert s.stop() == 0, s.log[-3000:]
    assert TOKEN not in s.log


def test_init_group_leniency_and_strictness(server):
    """SGLang converts a string master_port and our pp_rank is 0; a non-zero pp_rank or a port that is not a
    number is refused with the field named, before any group is formed."""
    base = {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2, "backend": "gloo"}
    for extra, words in (({"master_port": "29x"}, "master_port must be a port number"),
                         ({"master_port": "70000"}, "master_port must be in [1, 65535]"),
                         ({"master_port": 29500, "pp_rank": 1}, "pp_rank=1 is not supported")):
        r = server.http.post("/init_weights_update_group", json={**base, **extra})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("flags", list(SLIME_SERVER_CHECK))
def test_slime_server_args_check_passes(flags, tiny_model):
    """slime's external-engine start-up check (its fields and expected values, data from its source): on the
    server's default arguments, and with --enable-memory-saver where slime runs with --offload-rollout."""
    s = ServerProcess(tiny_model, *(["--enable-memory-saver"] if flags == "--offload-rollout" else []))
    try:
        for endpoint in ("/server_info", "/get_server_info"):   # slime tries the first, then the second
            info = s.http.get(endpoint).json()
            for name, expected in SLIME_SERVER_CHECK[flags].items():
                assert info.get(name) == expected, (endpoint, name, info.get(name), expected)
        # and what the flag decides: memory is released only with it, else a 400 naming it
        r = s.http.post("/release_memory_occupation", json={})
        if info["enable_memory_saver"]:   # {} releases every tag; resuming two leaves the third, named
            assert r.status_code == 200
            for tags in (["weights"], ["kv_cache"]):
                assert s.http.post("/resume_memory_occupation", json={"tags": tags}).status_code == 200
            r = s.http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 400 and 'tag(s) cuda_graph still released' in r.text, r.text
            assert s.http.post("/resume_memory_occupation", json={"tags": ["cuda_graph"]}).status_code == 200
        else:
            assert r.status_code == 400 and "--enable-memory-saver" in r.json()["error"]["message"], r.text
        assert s.http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
                           ).status_code == 200
    finally:
        assert s.stop() == 0, s.log[-3000:]


def test_refused_calls_name_what_is_unsupported(server):
    """Routes and fields the frameworks call that this engine does not serve: a status and a message that
    names them (never a bare 404, never a silent ignore); the server keeps serving."""
    for framework, method, path, body, status, words in REFUSED:
        r = server.http.request(method, path, **({} if body is None else {"json": body}))
        assert r.status_code == status and words in r.text, (framework, path, r.status_code, r.text[:300])
    r = server.http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
