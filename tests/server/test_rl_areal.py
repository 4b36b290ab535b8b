"""Issue 63, Must show 2: AReaL's released package (areal 1.0.4, tests/rl_clients.py) drives a `pdrollout serve`
started as the operator starts it (the trainer's address in --admin-peers, an admin token it does not send)
with its own HTTP code, unpatched: RemoteSGLangEngine generates, pauses, forms the weights update group and
sends the distributed update, continues, and generates again (tests/rl_areal_client.py; the trainer's
broadcast, FSDPEngine's part that needs a GPU, is replayed there with AReaL's own group helper). The tokens
before equal a fresh server's on the first checkpoint, after on the pushed one."""
from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

import rl_clients
from rl_common import ENGINE, checkpoint
from serverproc import ServerProcess

pytestmark = pytest.mark.timeout(900)
PROMPT = [3, 5, 7, 9, 11, 13]   # rl_areal_client.PROMPT


def greedy(s: ServerProcess) -> list[int]:
    r = s.http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_areal_generate_pause_update_continue(tmp_path):
    s0, s1 = checkpoint(tmp_path / "s0", 0), checkpoint(tmp_path / "s1", 1)
    (tmp_path / "token").write_text("operator-admin-token")
    operator_args = ["--mode", "pd", "--engine-config", ENGINE, "--admin-token-file", str(tmp_path / "token"),
                     "--admin-peers", "127.0.0.1/32"]
    fresh = ServerProcess(s1, *operator_args)
    try:
        ref1 = greedy(fresh)
    finally:
        assert fresh.stop() == 0, fresh.log[-3000:]
    s = ServerProcess(s0, *operator_args)
    try:
        ref0 = greedy(s)
        r = rl_clients.run("rl_areal_client.py", "--addr", s.url.removeprefix("http://"), "--model", s1)
        assert r.returncode == 0, r.stderr[-4000:] + s.log[-3000:]
        out = json.loads(r.stdout.splitlines()[-1])
        assert out["before"] == ref0 != ref1 and out["after"] == ref1, (out, ref0, ref1)
        # one update carried every tensor (AReaL sends all ParamSpecs in one body), and generation runs again
        n = len(load_file(f"{s1}/model.safetensors"))
        assert f"/update_weights_from_distributed: Succeeded to update {n} parameter(s)" in s.log
        assert not s.info()["paused"]
    finally:
        assert s.stop() == 0, s.log[-3000:]
