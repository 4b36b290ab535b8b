"""Issue 49, the verl adapter (engine/server/verl_rollout.py): verl 0.9.1's calls on its SGLang
rollout objects, as recorded in tests/server/data/verl_0.9.1_sglang_calls.json (verl does not
install here: the recording names its source), replayed through the adapter against a real
`pdrollout serve` started with an admin token, as the operator starts it. Every call succeeds,
each sends the HTTP route and body fields verl's own SGLang HTTP adapter sends, generate returns
what verl reads, and after the weight sync the greedy tokens are those of the new checkpoint."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rl_common import ENGINE, checkpoint
from serverproc import ServerProcess
from pdrollout.engine.server.verl_rollout import PdrolloutRollout, RolloutError

pytestmark = pytest.mark.timeout(900)
RECORDING = json.loads((Path(__file__).parent / "data" / "verl_0.9.1_sglang_calls.json").read_text())
TOKEN = "verl-admin-token"


class ObservedRollout(PdrolloutRollout):
    """The adapter as is, noting each HTTP call it makes (the calls still go to the server)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.sent: list[tuple[str, str, dict]] = []

    async def _call(self, method, path, body=None, admin=False):
        self.sent.append((method, path, body or {}))
        return await super()._call(method, path, body, admin)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("verl")
    return {"s0": checkpoint(d / "s0", 0), "s1": checkpoint(d / "s1", 1)}


def _matches(sent: list, recorded: list) -> None:
    """Each recorded HTTP call was sent in order, with the recorded body fields and tags."""
    i = 0
    for rec in recorded:
        hits = 0
        while i < len(sent) and (sent[i][0], sent[i][1]) == (rec["method"], rec["path"]):
            body = sent[i][2]
            assert set(rec.get("keys", ())) <= set(body), (rec, sorted(body))
            if "tags" in rec:
                assert body["tags"] == rec["tags"]
            hits, i = hits + 1, i + 1
        assert hits == 1 or (rec.get("per_bucket") and hits > 1), (rec, sent)
    assert i == len(sent), f"calls verl does not make: {sent[i:]}"


def test_verl_step_replayed_through_the_adapter(ckpts, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    s = ServerProcess(ckpts["s0"], "--engine-config", ENGINE, "--admin-token-file", str(token_file),
                      "--enable-memory-saver")   # verl starts SGLang with enable_memory_saver
    try:
        rollout = ObservedRollout(s.url, admin_token=TOKEN, bucket_megabytes=0.25)
        outs = []

        async def replay():
            for rec in RECORDING["calls"]:
                before = len(rollout.sent)
                args = dict(rec["args"])
                if rec["call"] == "update_weights":   # the actor's weights: the second checkpoint's tensors
                    args["weights"] = iter(load_file(f"{ckpts['s1']}/model.safetensors").items())
                result = await getattr(rollout, rec["call"])(**args)
                if rec["call"] == "generate":
                    outs.append((rec, result))
                _matches(rollout.sent[before:], rec["http"])
        asyncio.run(replay())

        for rec, out in outs:   # what verl reads of each answer
            sp = rec["args"]["sampling_params"]
            n = sp.get("max_new_tokens", sp.get("max_tokens"))
            assert len(out.token_ids) == n and all(isinstance(t, int) for t in out.token_ids)
            assert out.stop_reason == "completed"
            if sp.get("logprobs"):
                assert len(out.log_probs) == n and all(isinstance(x, float) and x <= 0 for x in out.log_probs)
            else:
                assert out.log_probs is None
        before, after = outs[0][1], outs[2][1]
        assert before.extra_fields["weight_version"] == "default" and after.extra_fields["weight_version"] == "1"
        assert after.extra_fields["global_steps"] == 1

        # the tokens after the sync are the second checkpoint's: the same server loading it from disk
        # (tests/server/test_rl_weights.py: a disk update equals a fresh engine) answers the same
        auth = {"Authorization": f"Bearer {TOKEN}"}
        r = s.http.post("/update_weights_from_disk", json={"model_path": ckpts["s1"]}, headers=auth)
        assert r.status_code == 200, r.text
        prompt = outs[2][0]["args"]["prompt_ids"]
        r = s.http.post("/generate", json={"input_ids": prompt, "sampling_params": {
            "temperature": 0, "max_new_tokens": 8, "ignore_eos": True}})
        assert r.json()["output_ids"] == after.token_ids != before.token_ids

        # without the token the adapter's mutating calls are refused, with the server's reason
        with pytest.raises(RolloutError, match="401"):
            asyncio.run(PdrolloutRollout(s.url).release())
    finally:
        assert s.stop() == 0, s.log[-3000:]
