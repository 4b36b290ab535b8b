"""The multi-rank engine on two GPUs (`gpu` marker; needs two CUDA devices): the delayed ACK (on by
default under fine-grained) gives the tokens of the synchronous D launch and of one rank, crossed
(ATP2) and uncrossed (ATP1, no turnstile); the uncrossed step log shows no round and no permit."""
from __future__ import annotations

import json

import pytest

from tests.distributed.test_mp_engine import BUDGET, ENGINE, FINE, PROMPTS, _outputs, _run, _steps

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip(f"two CUDA devices needed, {torch.cuda.device_count()} visible")
    from pdrollout.engine.model.checkpoint import write_checkpoint
    from pdrollout.engine.protocol.config import load_preset
    d = tmp_path_factory.mktemp("cuda-ranks")
    model = write_checkpoint(load_preset("tiny"), d / "tiny", seed=0)
    reqs = d / "reqs.jsonl"
    reqs.write_text("".join(json.dumps({"rid": f"r{i}", "input_ids": p, "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}) + "\n" for i, p in enumerate(PROMPTS)))
    return str(model), str(reqs), d


def _generate(setup, extra=()):
    model, reqs, _ = setup
    return _run(["generate", "--model", model, "--requests", reqs, "--mode", "pd", "--device", "cuda",
                 "--engine-config", json.dumps({**ENGINE, "dtype": "float32"}),
                 "--control", json.dumps({**BUDGET, **FINE}), *extra], 600)


@pytest.mark.parametrize("adp", [1, 2], ids=["atp2-crossed", "atp1-uncrossed"])
def test_cuda_delayed_ack_equals_the_synchronous_d_and_one_rank(setup, adp):
    ref = _outputs(_generate(setup))
    ranks = ["--nproc", "2", "--adp", str(adp), "--ep", "2"]
    log = setup[2] / f"steplog-adp{adp}"
    delayed = _outputs(_generate(setup, [*ranks, "--step-log", str(log)]))   # the default
    sync = _outputs(_generate(setup, [*ranks, "--no-d-async"]))
    assert delayed == sync == ref
    if adp == 2:
        for rank in (0, 1):
            assert all(s["rounds"] == 0 and s["permits"] == 0 for s in _steps(log, rank))
