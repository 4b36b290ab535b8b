"""One EP rank's P MoE layer captured as a CUDA graph (`gpu` marker, one GPU): the token-slot
exchange has no host sync, so the capture holds and its replays equal one rank's experts; the
counted path's capture fails, so a host sync would have been caught."""
import os
import sys

import pytest
import torch

from ranks import EXIT_OK, run_ranks

sys.path.insert(0, os.path.dirname(__file__))  # spawned ranks inherit sys.path and import the target
from slot_targets import capture_rank, pieces_rank  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def test_p_moe_exchange_of_one_ep_rank_captures_and_replays_equal():
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    (o,) = run_ranks(capture_rank, 1, (512,), timeout_s=500)
    assert o.exitcode == EXIT_OK, (o.exitcode, o.result)
    r = o.result
    print(r)
    assert r["reads"] == {"prefill": 0, "decode": 0}
    assert max(r["diffs"]) <= 1e-2 * r["scale"], r    # one bf16 rounding of the partial sum
    assert r["counted"] != "captured", r


@pytest.mark.parametrize("shape", ["tiny", "ep16-rank"])
def test_p_forward_through_the_multi_rank_path_captured_as_pieces(tmp_path, shape):
    """P's forward through RankCollectives (one NCCL rank; the expert exchange in token slots) as
    piecewise CUDA graphs: logits and K/V within bf16's tolerance of the one-rank eager forward, for
    the tiny model and for one EP16 rank of Qwen3-30B-A3B (8 of its 128 experts)."""
    from pdrollout.engine.model.checkpoint import write_checkpoint
    from pdrollout.engine.protocol.config import load_preset
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    model = str(write_checkpoint(load_preset("tiny"), tmp_path / "tiny", seed=0)) if shape == "tiny" else None
    (o,) = run_ranks(pieces_rank, 1, (model,), timeout_s=500)
    assert o.exitcode == EXIT_OK, (o.exitcode, o.result)
    r = o.result
    print(r)
    assert r["replays"] == 3 and r["reads"] == {"prefill": 0, "decode": 0}
    assert all(n > 1 for n in r["pieces"].values()), r    # graphs cut at each attention
    # padding changes the GEMMs' shapes, so bf16 sums round differently: bf16's tolerance, relative
    assert max(r["logits"]) <= 3e-2 * (1 + r["scale"]) and r["kv"] < 5e-2, r
