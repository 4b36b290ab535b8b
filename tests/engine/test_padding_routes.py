"""A decode graph's padding rows (`ForwardBatch.live` 0: seq_len 0) route to no expert: they would
all route as token 0 and read experts the real rows need not (qwen3_moe.MoEBlock._padding)."""
from __future__ import annotations

import pytest
import torch

from conftest import load_preset
from pdrollout.engine.model import qwen3_moe
from pdrollout.engine.model.backends import REFERENCE
from pdrollout.engine.model.checkpoint import random_model
from pdrollout.engine.model.qwen3_moe import Collectives, ForwardBatch
from pdrollout.engine.protocol.config import ModelConfig
from pdrollout.engine.protocol.plan import Phase


def _moe(block, x, lens, live=True):
    """The block over rows `x` of a decode batch with seq_lens `lens` (and `live` = them, as a decode
    graph's batch has it); (output, the ids it routed)."""
    b = x.shape[0]
    routes: list = []
    lens = torch.tensor(lens, dtype=torch.int32)
    batch = ForwardBatch(torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long),
                         [], torch.arange(b), phase=Phase.DECODE, num_decode=b, seq_lens=lens, routes=routes,
                         live=lens if live else None)
    return block(x, batch, Collectives()), routes[0]


@pytest.mark.parametrize("skip", [True, False])
def test_padding_rows_leave_the_real_rows_as_they_were_and_route_to_no_expert(skip, monkeypatch):
    monkeypatch.setattr(qwen3_moe, "SKIP_PADDING_ROUTES", skip)
    cfg = ModelConfig.from_dict(load_preset("tiny"))
    block = random_model(cfg, torch.device("cpu"), torch.float32, seed=1, backends=REFERENCE).model.layers[0].mlp
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    alone, ids_alone = _moe(block, x[:2], [7, 3])
    padded, ids = _moe(block, x, [7, 3, 0, 0, 0])
    assert torch.equal(ids[:2], ids_alone) and ids_alone.ge(0).all()
    if skip:   # no expert, no output
        assert ids[2:].eq(-1).all() and padded[2:].eq(0).all()
    else:      # padding rows share the real rows' experts' GEMMs
        assert ids[2:].ge(0).all() and padded[2:].abs().sum() > 0
    # equal up to fp32 rounding, not bitwise: a CPU BLAS may pick its kernel by the rows (here the
    # router's 5 against 2 gave other bits on one CI machine); the GPU's bitwise check of the graphs'
    # logits is e2e/gpu/padding_routes.py's
    assert torch.allclose(padded[:2], alone, rtol=1e-5, atol=1e-6)


def test_a_batch_without_live_rows_routes_every_row():
    """Eager forwards have no padding: without `live` every row routes, seq_lens or not."""
    cfg = ModelConfig.from_dict(load_preset("tiny"))
    block = random_model(cfg, torch.device("cpu"), torch.float32, seed=1, backends=REFERENCE).model.layers[0].mlp
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    _, ids = _moe(block, x, [4, 0, 0], live=False)
    assert ids.ge(0).all()


@pytest.mark.parametrize("skip", [True, False])
def test_p_pieces_padding_routes_only_under_its_own_switch(skip, monkeypatch):
    """P's pieces (eager on the CPU, through the same buffers and padding) after a longer forward
    left stale tokens in the bucket: with SKIP_P_PADDING_ROUTES (the default) those rows route to no
    expert, without it they route as real rows, and the decode switch alone never touches them; the
    real rows' logits are the eager forward's either way."""
    from pdrollout.engine.model import ops
    from pdrollout.engine.model.backends import Backends
    from pdrollout.engine.model.kv_cache import KVCache
    from pdrollout.engine.model.qwen3_moe import SeqSlice
    from pdrollout.engine.runtime.prefill_graphs import PrefillGraphs
    monkeypatch.setattr(qwen3_moe, "SKIP_P_PADDING_ROUTES", skip)
    monkeypatch.setattr(qwen3_moe, "SKIP_PADDING_ROUTES", True)
    seen: list = []

    def spy(logits, k, norm, dtype, live=None):
        w, ids = ops.route(logits, k, norm, dtype, live)
        seen.append((live if live is None else live.clone(), ids))
        return w, ids
    cfg = ModelConfig.from_dict(load_preset("tiny"))
    model = random_model(cfg, torch.device("cpu"), torch.float32, seed=1,
                         backends=Backends(REFERENCE.attention, REFERENCE.experts, router=spy))
    kv = KVCache(cfg.num_hidden_layers, 8, 16, model.model.layers[0].self_attn.kv_heads, cfg.head_dim,
                 torch.float32, "cpu")
    pieces = PrefillGraphs(model, kv, 16, graphs=False)
    pieces.capture()

    def batch(n, first_slot):
        slots = torch.arange(first_slot, first_slot + n)
        ids = torch.tensor([(i * 37) % (cfg.vocab_size - 2) + 2 for i in range(n)])
        return ForwardBatch(ids, torch.arange(n), slots, [SeqSlice(0, n, n, slots)], torch.tensor([n - 1]),
                            phase=Phase.PREFILL)
    pieces.forward(batch(13, 0))               # fills the 16-token bucket's first 13 rows
    seen.clear()
    got = pieces.forward(batch(5, 32))         # 5 real rows, 11 padding rows with stale tokens
    want = model(batch(5, 64), kv)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    piece_calls = seen[:cfg.num_hidden_layers]
    assert len(piece_calls) == cfg.num_hidden_layers and all(ids.shape[0] == 16 for _, ids in piece_calls)
    for live, ids in piece_calls:
        assert ids[:5].ge(0).all()
        if skip:
            assert live.tolist() == [1] * 5 + [0] * 11 and ids[5:].eq(-1).all()
        else:
            assert live is None and ids[5:].ge(0).all()
