"""CUDA fast paths, each tested against its reference in ops.py (tests/engine/test_kernels.py, GPU):

* `decode_attention`: a Triton paged-attention kernel for one query per sequence (GQA groups share
  each K/V tile), with tensor-only metadata so it can live inside a CUDA graph; optionally split
  along the context (flash-decoding: `kv_splits` programs per (row, KV head), each a slice of the
  context, merged by their log-sum-exp), so a batch of few rows still fills the GPU;
* `prefill_attention`: SDPA per sequence over the gathered context with a bottom-right causal mask;
* `fresh_prefill_attention`: fresh prompts only, on SDPA's cuDNN backend, lengths rounded up to a
  bucket and batched per length (a bounded set of cuDNN plans);
* `experts_grouped`: routed experts through two `torch._grouped_mm` calls (fixed shapes: graph-safe).
Triton is imported lazily: CPU-only installs never need it.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from ..protocol.config import KV_SPLITS_MAX


def triton_interpreting() -> bool:
    """Triton's CPU interpreter is on (tests: TRITON_INTERPRET=1 before Triton's first import)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _decode_kernels():
    import triton
    import triton.language as tl

    # the block tables' width follows the batch's longest row, the split count the batch's rows: neither
    # is specialized (the splits are the grid's third axis), so no served step compiles (runtime/jit_watch.py)
    @triton.jit(do_not_specialize=["sbt_b"])
    def attend(q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, scale,
               sq_b, sq_h, sk_s, sk_h, sbt_b, so_b, so_h,
               GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
               BLOCK: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, F32: tl.constexpr):
        """One (row, KV head, split): online softmax over the split's slice of the row's context.
        Not SPLIT (one split): the whole context, written as the output. Else a normalized partial
        into [B, H, splits, D] fp32 and its log-sum-exp (-inf for an empty slice), for `merge`."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp, splits = tl.program_id(2), tl.num_programs(2)
        seq_len = tl.load(len_ptr + b)
        # slices of whole tiles, sized from this row's length: the grid is fixed (graph-safe)
        per = tl.cdiv(tl.cdiv(seq_len, splits), TILE) * TILE
        lo = sp * per
        hi = tl.minimum(lo + per, seq_len)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D)
        gmask = g < GROUP
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=gmask[:, None], other=0.0)
        if F32:   # the interpreter's bf16 dot is wrong; fp32 products of bf16 are exact
            q = q.to(tl.float32)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        for start in range(lo, hi, TILE):
            pos = start + tl.arange(0, TILE)
            pmask = pos < hi
            blk = tl.load(bt_ptr + b * sbt_b + pos // BLOCK, mask=pmask, other=0)
            slot = blk.to(tl.int64) * BLOCK + pos % BLOCK
            k = tl.load(k_ptr + slot[:, None] * sk_s + kvh * sk_h + d[None, :], mask=pmask[:, None], other=0.0)
            v = tl.load(v_ptr + slot[:, None] * sk_s + kvh * sk_h + d[None, :], mask=pmask[:, None], other=0.0)
            if F32:
                k, v = k.to(tl.float32), v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
            s = tl.where(pmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            m = m_new
        out = acc / tl.maximum(l, 1e-30)[:, None]    # an empty context (a padding row) → zeros
        if not SPLIT:
            tl.store(o_ptr + b * so_b + heads[:, None] * so_h + d[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=gmask[:, None])
        else:
            lse = tl.where(l > 0, m + tl.log(tl.maximum(l, 1e-30)), float("-inf"))
            at = (b * (GROUP * tl.num_programs(1)) + heads) * splits + sp
            tl.store(o_ptr + at[:, None] * D + d[None, :], out, mask=gmask[:, None])
            tl.store(lse_ptr + at, lse, mask=gmask)

    @triton.jit(do_not_specialize=["splits"])
    def merge(o_ptr, lse_ptr, out_ptr, so_b, so_h, splits, H: tl.constexpr, D: tl.constexpr,
              SPLITS_PAD: tl.constexpr):
        """One (row, head): the splits' partials weighted by exp(lse - max lse); a row with no
        context (padding) gets zeros."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, D)
        smask = sp < splits
        at = (b * H + h) * splits + sp
        lse = tl.load(lse_ptr + at, mask=smask, other=float("-inf"))
        top = tl.max(lse, 0)
        w = tl.where(lse > float("-inf"), tl.exp(lse - tl.where(top > float("-inf"), top, 0.0)), 0.0)
        parts = tl.load(o_ptr + at[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
        out = tl.sum(parts * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
        tl.store(out_ptr + b * so_b + h * so_h + d, out.to(out_ptr.dtype.element_ty))

    return attend, merge


# Flash-decoding targets this many programs per SM: with 128-key tiles one wave is enough, more splits
# only add the merge (decode_attn.py's sweep; docs/PERF.md, "Kernel choices").
SPLIT_PROGRAMS_PER_SM = 1
MAX_KV_SPLITS = KV_SPLITS_MAX
MERGE_PAD = 1 << (MAX_KV_SPLITS - 1).bit_length()   # one merge compile for every split count


def kv_splits_for(rows: int, kv_heads: int, max_context: int, sms: int, tile: int = 128) -> int:
    """Splits per (row, KV head) from shapes alone (the padded batch, the block table's width), so a
    captured graph keeps its grid: enough programs for the SMs, no split shorter than one tile."""
    want = -(-SPLIT_PROGRAMS_PER_SM * sms // max(rows * kv_heads, 1))
    return max(1, min(want, MAX_KV_SPLITS, -(-max_context // tile)))


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index or 0).multi_processor_count


def decode_launch(dtype: torch.dtype, block_size: int, interpret: bool = False) -> tuple[int, int]:
    """(tile, num_stages) of the decode attention. 16-bit caches: 128-key tiles, 3 stages (the H200 at
    batch 64, 2k: 69 µs a layer against 83 with 64-key tiles and 2 stages; 32×2k and 64×4k alike:
    decode_attn.py's sweep); fp32 caches (the exact paths) and the interpreter: 64-key tiles, 2 stages
    (a 128-key fp32 stage would not fit shared memory three times). A block wider than the tile sets it."""
    tile, stages = (64, 2) if dtype == torch.float32 or interpret else (128, 3)
    return max(tile, block_size), stages


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, block_size: int, scale: float,
                     kv_splits: int | str = 1, tile: int | None = None, num_warps: int = 4,
                     num_stages: int | None = None, out: torch.Tensor | None = None):
    """q: [B, H, D]; k/v_cache: [slots, KVH, D]; block_tables: int32 [B, max_blocks];
    seq_lens: int32 [B] (0 for padding rows). Returns [B, H, D] (`out` when given: written in place,
    no copy of the result a layer). `kv_splits`: 1 for one pass per
    (row, KV head); n > 1 or "auto" (kv_splits_for) to split each row's context n ways. `tile` (keys
    a loop step reads), `num_warps`, `num_stages`: decode_launch's unless given (decode_attn.py's sweep)."""
    import triton
    b, h, d = q.shape
    kvh = k_cache.shape[1]
    group = h // kvh
    o = torch.empty_like(q) if out is None else out
    interpret = triton_interpreting()
    default_tile, default_stages = decode_launch(k_cache.dtype, block_size, interpret)
    tile, num_stages = tile or default_tile, num_stages or default_stages
    if kv_splits == "auto":
        sms = _sm_count(q.device.index) if q.device.type == "cuda" else 132
        kv_splits = kv_splits_for(b, kvh, block_tables.shape[1] * block_size, sms, tile)
    attend, merge = _decode_kernels()
    if kv_splits == 1:
        parts, lse, so = o, o, (o.stride(0), o.stride(1))
    else:
        parts = torch.empty(b, h, kv_splits, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, h, kv_splits, dtype=torch.float32, device=q.device)
        so = (0, 0)
    attend[(b, kvh, kv_splits)](q, k_cache, v_cache, block_tables, seq_lens, parts, lse, scale,
                                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                                block_tables.stride(0), *so,
                                GROUP=group, GROUP_PAD=max(16, 1 << (group - 1).bit_length()), D=d,
                                SPLIT=kv_splits > 1, BLOCK=block_size, TILE=tile, num_warps=num_warps,
                                num_stages=num_stages,
                                PRECISION="ieee" if q.dtype == torch.float32 or interpret else "tf32",
                                F32=interpret)
    if kv_splits > 1:
        merge[(b, h)](parts, lse, o, o.stride(0), o.stride(1), kv_splits, H=h, D=d,
                      SPLITS_PAD=max(MERGE_PAD, triton.next_power_of_2(kv_splits)), num_warps=4)
    return o


def prefill_attention(q, k_cache, v_cache, seqs, scale: float, out=None):
    """Per-sequence SDPA over the gathered context; queries are the last q_len context positions."""
    from torch.nn.attention.bias import causal_lower_right
    out = torch.empty_like(q) if out is None else out
    for s in seqs:
        qs = q[s.q_start:s.q_start + s.q_len].transpose(0, 1).unsqueeze(0)
        k = k_cache.index_select(0, s.slots).transpose(0, 1).unsqueeze(0)
        v = v_cache.index_select(0, s.slots).transpose(0, 1).unsqueeze(0)
        if s.q_len == s.ctx_len:     # fresh prompt: plain causal keeps SDPA on its flash kernel
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:                        # continuation: queries are the last q_len of ctx_len positions
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=causal_lower_right(s.q_len, s.ctx_len),
                                               scale=scale, enable_gqa=True)
        out[s.q_start:s.q_start + s.q_len] = o.squeeze(0).transpose(0, 1)
    return out


# Fresh segments are padded up to a multiple of this many tokens: cuDNN builds an execution plan
# per new shape (docs/PERF.md), so rounding bounds the plans a process builds.
FRESH_BUCKET = 512


def fresh_groups(seqs, bucket: int = FRESH_BUCKET) -> dict[int, list]:
    """Segments by their length rounded up to `bucket`: one SDPA call (a batch) per group."""
    groups: dict[int, list] = {}
    for s in seqs:
        groups.setdefault(-(-s.q_len // bucket) * bucket, []).append(s)
    return groups


def _cudnn(device: torch.device):
    """SDPA's cuDNN backend for this call only (the worker leaves it off for every other SDPA)."""
    import contextlib
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION])


def _full_and_adjacent(group, length: int) -> bool:
    return all(s.q_len == length and s.q_start == group[0].q_start + i * length for i, s in enumerate(group))


def _group_queries(q, group, length: int):
    """The group's queries as (segments, length, heads, dim): a view when they lie back to back at
    full length, else a zero-padded copy."""
    n = len(group)
    if _full_and_adjacent(group, length):
        return q[group[0].q_start:group[0].q_start + n * length].view(n, length, *q.shape[1:])
    out = q.new_zeros(n, length, *q.shape[1:])
    for i, s in enumerate(group):
        out[i, :s.q_len] = q[s.q_start:s.q_start + s.q_len]
    return out


def _group_context(cache, group, length: int):
    """The group's K or V out of the cache as (segments, length, kv heads, dim): one gather when
    every segment is at full length, else zero padded (never stale cache slots: 0 x NaN would
    leak through the masked keys' probabilities)."""
    n = len(group)
    if all(s.q_len == length for s in group):
        slots = torch.cat([s.slots for s in group]) if n > 1 else group[0].slots
        return cache.index_select(0, slots).view(n, length, *cache.shape[1:])
    out = cache.new_zeros(n, length, *cache.shape[1:])
    for i, s in enumerate(group):
        torch.index_select(cache, 0, s.slots, out=out[i, :s.q_len])
    return out


def fresh_prefill_attention(q, k_cache, v_cache, seqs, scale: float, out=None, bucket: int = FRESH_BUCKET):
    """Fresh prompts only (every segment's q_len == ctx_len): causal SDPA on cuDNN, one call per
    group of segments whose lengths round up to the same multiple of `bucket`. Padded keys come
    after every real query, so causal masking hides them from the real rows."""
    assert all(s.q_len == s.ctx_len for s in seqs), "fresh prompts only"
    out = torch.empty_like(q) if out is None else out
    for length, group in fresh_groups(seqs, bucket).items():
        qb = _group_queries(q, group, length)
        kb, vb = _group_context(k_cache, group, length), _group_context(v_cache, group, length)
        with _cudnn(q.device):
            o = F.scaled_dot_product_attention(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2),
                                               is_causal=True, scale=scale, enable_gqa=True)
        o = o.transpose(1, 2)   # (segments, length, heads, dim)
        for i, s in enumerate(group):
            out[s.q_start:s.q_start + s.q_len] = o[i, :s.q_len]
    return out


def fresh_shapes(max_tokens: int, min_tokens: int, bucket: int = FRESH_BUCKET) -> list[tuple[int, int]]:
    """Every (segments, padded length) `fresh_prefill_attention` can run for a step of at most
    `max_tokens` fresh tokens in segments of at least `min_tokens`: what a warm-up builds."""
    first = -(-min_tokens // bucket) * bucket
    # n segments in one group: the shortest holds at most max_tokens // n, and all round up alike
    return [(n, length) for n in range(1, max_tokens // min_tokens + 1)
            for length in range(first, -(-(max_tokens // n) // bucket) * bucket + 1, bucket)]


def _sorted_rows(topk_ids, num_local: int, expert_offset: int):
    """Routed rows sorted by local expert (foreign experts last), group offsets, and the inverse
    permutation; all fixed-shape so the whole MoE block stays graph-capturable."""
    local = (topk_ids - expert_offset).flatten()
    owned = (local >= 0) & (local < num_local)
    key = torch.where(owned, local, torch.full_like(local, num_local))
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.int32, device=topk_ids.device)
    counts.index_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offs = torch.cumsum(counts[:num_local], 0, dtype=torch.int32)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return order, offs, inverse, owned


def experts_grouped(x, topk_ids, topk_weights, gate_up, down, expert_offset: int = 0):
    """Same function as ops.experts_reference through two grouped GEMMs (bf16, SM90)."""
    t, k = topk_ids.shape
    order, offs, inverse, owned = _sorted_rows(topk_ids, gate_up.shape[0], expert_offset)
    rows = x.index_select(0, order // k)
    h = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offs)
    # Back to (token, slot) order; rows of foreign experts (past offs[-1], unwritten) are masked.
    y = y.index_select(0, inverse).view(t, k, -1)
    w = torch.where(owned, topk_weights.flatten().float(), 0.0).view(t, k, 1)
    y = torch.where(w != 0, y.float(), 0.0)
    return (y * w).sum(1).to(x.dtype)


def experts_gathered(x, topk_ids, topk_weights, gate_up, down, expert_offset: int = 0):
    """Graph-safe experts for dtypes grouped GEMM lacks (fp32 exactness runs): gathers each routed
    row's expert weights and uses batched matmuls. Memory grows with rows × expert size: small models."""
    t, k = topk_ids.shape
    e = gate_up.shape[0]
    local = topk_ids - expert_offset
    owned = (local >= 0) & (local < e)
    idx = torch.where(owned, local, 0).flatten()
    rows = x.repeat_interleave(k, dim=0).unsqueeze(-1)                    # [t*k, H, 1]
    h = torch.bmm(gate_up.index_select(0, idx), rows).squeeze(-1)          # [t*k, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch.bmm(down.index_select(0, idx), (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
    w = torch.where(owned, topk_weights, torch.zeros_like(topk_weights)).view(t, k, 1)
    return (y.view(t, k, -1) * w).sum(1)
