"""`prefill_attention: hybrid`'s fresh-prompt path (kernels.fresh_prefill_attention) on the CPU:
bucketing and batching must not change what each prompt attends to. cuDNN itself runs on the GPU
(tests/engine/test_kernels.py); here SDPA's CPU backend takes the same padded, batched calls."""
from __future__ import annotations

import random

import pytest
import torch

from pdrollout.engine.model import kernels, ops
from pdrollout.engine.model.kernels import fresh_groups, fresh_prefill_attention, fresh_shapes
from pdrollout.engine.model.qwen3_moe import SeqSlice


def fresh(lengths, h=8, kvh=2, d=16, adjacent=True, seed=0):
    """Fresh prompts packed in q (with a gap between them unless adjacent), their K/V in scattered
    cache slots; every slot no prompt holds is NaN."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths) + 7
    k = torch.full((total, kvh, d), float("nan"))
    v = torch.full((total, kvh, d), float("nan"))
    perm = torch.randperm(total, generator=g)
    seqs, start, at = [], 0, 0
    for n in lengths:
        slots = perm[at:at + n]
        at += n
        k[slots], v[slots] = torch.randn(n, kvh, d, generator=g), torch.randn(n, kvh, d, generator=g)
        seqs.append(SeqSlice(start, n, n, slots))
        start += n + (0 if adjacent else 3)
    q = torch.randn(start, h, d, generator=g)
    return q, k, v, seqs


@pytest.mark.parametrize("lengths,adjacent", [
    ([16, 16, 16], True),          # one group, back to back at the bucket's length: views, no copy
    ([16, 16, 16], False),         # same lengths, not adjacent: padded copies
    ([5, 16, 13, 29, 32, 1], True),  # three buckets, ragged within each
])
def test_bucketed_batches_equal_the_reference(lengths, adjacent):
    q, k, v, seqs = fresh(lengths, adjacent=adjacent)
    out = torch.full_like(q, 7.0)
    fresh_prefill_attention(q, k, v, seqs, 0.25, out=out, bucket=16)
    ref = ops.paged_attention(q.double(), k.double(), v.double(), seqs, 0.25)
    for s in seqs:
        rows = slice(s.q_start, s.q_start + s.q_len)
        assert torch.isfinite(out[rows]).all(), s   # padding read zeros, never a NaN slot
        torch.testing.assert_close(out[rows].double(), ref[rows], rtol=1e-5, atol=1e-5)
    if not adjacent:   # rows between prompts are not the path's to write
        assert (out[16:19] == 7.0).all()


def test_one_sdpa_call_per_bucket(monkeypatch):
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention",
                        lambda q, *a, **kw: calls.append(tuple(q.shape)) or sdpa(q, *a, **kw))
    q, k, v, seqs = fresh([5, 16, 13, 29, 32, 1])
    fresh_prefill_attention(q, k, v, seqs, 0.25, bucket=16)
    # (segments, heads, padded length, dim): 16 holds 5, 16, 13 and 1; 32 holds 29 and 32
    assert sorted(calls) == [(2, 8, 32, 16), (4, 8, 16, 16)]
    assert {n: len(g) for n, g in fresh_groups(seqs, 16).items()} == {16: 4, 32: 2}


def test_a_continuation_is_refused():
    q, k, v, seqs = fresh([8])
    with pytest.raises(AssertionError, match="fresh prompts only"):
        fresh_prefill_attention(q, k, v, [SeqSlice(0, 4, 8, seqs[0].slots)], 0.25, bucket=16)


def test_warm_shapes_cover_every_step_a_budget_allows():
    """Any split of up to max_tokens into fresh prompts of at least min_tokens runs only shapes
    fresh_shapes lists (what the multi-rank warm-up builds), and no listed shape is impossible."""
    max_tokens, low, bucket = 8192, 2048, 512
    shapes = set(fresh_shapes(max_tokens, low, bucket))
    assert len(shapes) == len(fresh_shapes(max_tokens, low, bucket)) == 22
    rng, seen = random.Random(0), set()
    for _ in range(20000):
        left, lengths = max_tokens, []
        while left >= low and (not lengths or rng.random() < 0.7):
            n = low if rng.random() < 0.3 else rng.randint(low, left)   # chunked prompts: exactly low
            lengths.append(n)
            left -= n
        seqs = [SeqSlice(0, n, n, None) for n in lengths]
        for length, group in fresh_groups(seqs, bucket).items():
            assert (len(group), length) in shapes, lengths
            seen.add((len(group), length))
    assert seen == shapes
    assert fresh_shapes(1024, 2048) == []


def test_warm_up_runs_every_shape_once(monkeypatch):
    """Several ranks build every fresh shape before P and D overlap (runtime/warmup.py), with the
    model's own heads and dtype."""
    from pdrollout.engine.model import backends
    from pdrollout.engine.model.checkpoint import random_model
    from pdrollout.engine.protocol.config import ModelConfig
    from pdrollout.engine.runtime.warmup import warm_fresh_attention
    from conftest import load_preset
    cfg = ModelConfig.from_dict(load_preset("tiny"))
    model = random_model(cfg, torch.device("cpu"), torch.bfloat16, seed=1)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention",
                        lambda q, *a, **kw: calls.append((tuple(q.shape), q.dtype)) or sdpa(q, *a, **kw))
    monkeypatch.setattr(backends, "SDPA_FRESH_MIN_TOKENS", 300)
    attn = model.model.layers[0].self_attn
    assert warm_fresh_attention(model, 1200, torch.device("cpu"), 0) == len(fresh_shapes(1200, 300)) == 7
    assert sorted(calls) == sorted(((n, attn.heads, length, attn.head_dim), torch.bfloat16)
                                   for n, length in fresh_shapes(1200, 300))
    assert warm_fresh_attention(model, 299, torch.device("cpu"), 0) == 0
    calls.clear()   # a budget over the cap: only the shapes under it (larger steps run the launch)
    monkeypatch.setattr(backends, "SDPA_FRESH_MAX_TOKENS", 900)
    assert warm_fresh_attention(model, 5000, torch.device("cpu"), 0) == len(fresh_shapes(900, 300)) == 4
    assert sorted(calls) == sorted(((n, attn.heads, length, attn.head_dim), torch.bfloat16)
                                   for n, length in fresh_shapes(900, 300))


@pytest.mark.parametrize("setting,dtype,capability,cudnn,want", [
    ("auto", torch.bfloat16, (9, 0), True, "hybrid"),    # the H200: launch + cuDNN for fresh prompts
    ("auto", torch.bfloat16, (8, 0), True, "triton"),    # not measured before SM90: the launch alone
    ("auto", torch.bfloat16, (9, 0), False, "triton"),   # no cuDNN in this torch
    ("auto", torch.float16, (9, 0), True, "sdpa"),       # the launch is bf16 only
    ("auto", torch.float32, (9, 0), True, "sdpa"),       # fp32: the exact path
    ("triton", torch.bfloat16, (9, 0), True, "triton"),  # a setting is kept as given
    ("hybrid", torch.bfloat16, (8, 0), True, "hybrid"),
])
def test_auto_prefill_attention(setting, dtype, capability, cudnn, want):
    from pdrollout.engine.model.backends import prefill_kernel
    assert prefill_kernel(setting, dtype, capability, cudnn) == want
