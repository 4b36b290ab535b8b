"""P's piecewise forward (runtime/prefill_graphs.py): the model cut at each attention, run through
static buffers padded to a token bucket. On CPU the pieces run eagerly, so what is tested here is
the cut, the buffers and the padding: logits and K/V equal to the model's own forward, padding that
writes only the null slot (also with a previous forward's slots left in the buffer), and the engine's
outputs equal with and without the pieces in every mode. The captured graphs: GPU tests
(test_cuda_reference.py, test_kernels.py)."""
from __future__ import annotations

import pytest
import torch

from hf_reference import PROMPTS, run_all
from prefill_batch import batch_of
from pdrollout.engine.model.kv_cache import KVCache
from pdrollout.engine.model.loader import load_model
from pdrollout.engine.protocol.config import ControlSettings, EngineConfig
from pdrollout.engine.runtime.engine import Engine
from pdrollout.engine.runtime.prefill_graphs import PrefillGraphs, buckets

BLOCK = 4


def kv_for(model, blocks: int = 32) -> KVCache:
    cfg = model.cfg
    return KVCache(cfg.num_hidden_layers, blocks, BLOCK, model.model.layers[0].self_attn.kv_heads, cfg.head_dim,
                   torch.float32, "cpu")


def test_buckets_bound_the_padding_and_end_at_the_bound():
    assert buckets(100) == [16, 32, 48, 64, 96, 100]
    assert buckets(16) == [16] and buckets(5) == [5]
    b = buckets(4096)
    assert b[-1] == 4096 and all(y <= 1.5 * x for x, y in zip(b, b[1:]) if x >= 32)
    with pytest.raises(ValueError, match="token bound"):
        buckets(0)


def test_the_pieces_equal_the_forward_and_padding_writes_only_the_null_slot(tiny_model):
    model = load_model(tiny_model, dtype=torch.float32)
    kv_ref, kv = kv_for(model), kv_for(model)
    graphs = PrefillGraphs(model, kv, 40, graphs=False)
    graphs.capture()
    a = [(i * 37) % 500 + 2 for i in range(23)]
    b = [(i * 11) % 509 + 2 for i in range(9)]
    steps = [
        batch_of([(a[:17], 0, 0), (b, 0, 64)]),   # 26 tokens: bucket 32, 6 rows of padding
        batch_of([(a[17:], 17, 0)]),             # a continuation over cached context: 6 tokens, bucket 16
    ]
    for step in steps:
        assert graphs.fits(step)
        ref = model(step, kv_ref)
        out = graphs.forward(step)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    null = kv.null_slot
    for i in range(model.cfg.num_hidden_layers):
        # every real slot as the eager forward wrote it; padding touched the null slot alone (the
        # second step's padding rows held the first step's real slots in the buffer before the fill)
        torch.testing.assert_close(kv.k[i][:null], kv_ref.k[i][:null], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv.v[i][:null], kv_ref.v[i][:null], rtol=1e-5, atol=1e-5)
        assert kv.k[i][null].abs().sum() > 0   # padding rows did write it
    assert graphs.replays == 2


def test_what_the_pieces_do_not_hold_runs_eagerly(tiny_model):
    model = load_model(tiny_model, dtype=torch.float32)
    graphs = PrefillGraphs(model, kv_for(model), 16, graphs=False)
    step = batch_of([([3, 4, 5], 0, 0)])
    assert not graphs.fits(step)          # not captured yet
    graphs.capture()
    assert graphs.fits(step)
    assert not graphs.fits(batch_of([(list(range(2, 19)), 0, 0)]))   # 17 tokens: past the bound
    step.routes = []
    assert not graphs.fits(step)          # routing replay: the pieces keep no ids
    graphs.drop()
    step.routes = None
    assert not graphs.fits(step)          # dropped for a memory release


def test_the_pieces_give_mtp_its_hidden_states(tiny_model):
    """The final norm runs after the last piece over every real row: MTP's hidden states (and the
    logits beside them) equal the eager forward's, padding rows excluded."""
    model = load_model(tiny_model, dtype=torch.float32)
    kv_ref, kv = kv_for(model), kv_for(model)
    graphs = PrefillGraphs(model, kv, 32, graphs=False)
    graphs.capture()
    segs = [([(i * 13) % 400 + 2 for i in range(11)], 0, 0), ([5, 6, 7, 8, 9], 0, 64)]   # 16 tokens
    ref_step, step = batch_of(segs), batch_of(segs[:1] + [(segs[1][0][:4], 0, 64)])      # 15: one padding row
    ref_step.want_hidden = step.want_hidden = True
    ref = model(ref_step, kv_ref)
    assert graphs.fits(step)
    got = graphs.forward(step)
    assert step.hidden.shape[0] == 15
    torch.testing.assert_close(step.hidden, ref_step.hidden[:15], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)   # the first segment's logits


@pytest.mark.parametrize("mode", ["normal", "mixed", "pd"])
def test_engine_outputs_equal_with_and_without_the_pieces(tiny_model, mode):
    """The bound (32) sits inside the prompts' lengths (1-70): P forwards both fit and do not."""
    outs, replays = {}, {}
    for bound in (0, 32):
        e = Engine(EngineConfig(model=str(tiny_model), dtype="float32", mode=mode, block_size=BLOCK, num_blocks=256,
                                mixed_chunk_tokens=20, prefill_graph_tokens=bound,
                                control=ControlSettings(prefill_budget_tokens=24)))
        assert (e.worker.p_graphs is None) == (bound == 0)
        outs[bound] = run_all(e, PROMPTS, max_new=8, ignore_eos=True)
        replays[bound] = e.worker.p_graphs.replays if e.worker.p_graphs else 0
        e.shutdown()
    assert outs[32] == outs[0]
    assert replays[32] > 0


def test_memory_release_drops_the_pieces_and_resume_captures_them_again(tiny_model):
    e = Engine(EngineConfig(model=str(tiny_model), dtype="float32", prefill_graph_tokens=32))
    before = run_all(e, PROMPTS[:3], max_new=6, ignore_eos=True)
    e.release_memory(None)
    assert not e.worker.p_graphs.pieces
    e.resume_memory(None)
    assert e.worker.p_graphs.pieces
    n = e.worker.p_graphs.replays
    assert run_all(e, PROMPTS[:3], max_new=6, ignore_eos=True) == before
    assert e.worker.p_graphs.replays > n
    e.shutdown()


def test_the_bound_defaults_by_device_and_world():
    cfg = EngineConfig(model="m")
    assert cfg.prefill_graph_tokens_on("cpu", False) == 0
    assert cfg.prefill_graph_tokens_on("cuda", False) == 4096
    assert cfg.prefill_graph_tokens_on("cuda", True) == 0       # several ranks with P not in pieces (ATP > 1, DeepEP)
    assert EngineConfig(model="m", cuda_graphs=False).prefill_graph_tokens_on("cuda", False) == 0
    assert EngineConfig(model="m", prefill_graph_tokens=64).prefill_graph_tokens_on("cpu", False) == 64
    with pytest.raises(ValueError):
        EngineConfig(model="m", prefill_graph_tokens=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphed_pieces_equal_the_eager_forward(tiny_model, dtype):
    """Captured pieces replayed on CUDA: the same logits and K/V as the eager forward, within bf16's
    tolerance (padding changes the GEMMs' shapes, not their math), twice in one bucket."""
    from pdrollout.engine.model.backends import make_backends
    dev = torch.device("cuda")
    backends = make_backends(dev, dtype)
    model = load_model(tiny_model, device=dev, dtype=dtype, backends=backends)
    cfg = model.cfg

    def cache():
        return KVCache(cfg.num_hidden_layers, 64, BLOCK, model.model.layers[0].self_attn.kv_heads, cfg.head_dim,
                       dtype, dev)
    kv_ref, kv = cache(), cache()
    graphs = PrefillGraphs(model, kv, 64)
    graphs.capture()
    assert all(len(p) == cfg.num_hidden_layers + 1 for p in graphs.pieces.values())
    a = [(i * 37) % 500 + 2 for i in range(40)]
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for segs in ([(a[:30], 0, 0), (a[:9], 0, 128)], [(a[30:], 30, 0)], [(a[9:20], 9, 128)]):
        step = batch_of(segs, dev)
        torch.testing.assert_close(graphs.forward(step), model(step, kv_ref), **tol)
    null = kv.null_slot
    for i in range(cfg.num_hidden_layers):
        torch.testing.assert_close(kv.k[i][:null], kv_ref.k[i][:null], **tol)
    assert graphs.replays == 3
