"""Attention and expert backends, chosen once per worker from its device and dtype.

The model calls `backends.attention(...)` and `backends.experts(...)`; it never branches on the
batch to pick a kernel. The batch builder asks the attention backend which metadata it needs.

  attention  ReferenceAttention  ops.paged_attention per sequence (CPU: the exactness reference)
                                 (each attention backend also owns the prologue: q/k norm, RoPE,
                                 KV write; torch ops, or prologue.py's kernels with `qk_prologue: fused`)
             PagedAttention      CUDA: Triton paged decode kernel for the decode rows (tensor-only
                                 metadata: graph-capturable); prefill segments all in one Triton
                                 launch from the paged cache (bf16), or SDPA per segment over its
                                 gathered context (`prefill_attention: sdpa`; fp32), or per step:
                                 SDPA on cuDNN when every segment is a long fresh prompt
                                 (`hybrid`: lengths bucketed, a bounded set of cuDNN plans)
  experts    ReferenceExperts    one expert at a time (CPU)
             GroupedExperts      two grouped GEMMs (bf16 on SM90+; fixed shapes: graph-capturable)
             FusedExperts        two Triton kernels, SiLU·up and the routing weight fused in, blocks of
                                 16 rows per expert (fused_moe.py; `experts_kernel: fused`); FP8
                                 experts stay e4m3 in HBM, dequantized per tile in registers
             AutoExperts         fused, with 16-, 64- or 128-row tiles by the rows an expert sees
                                 (bf16 on SM90+, where it was measured: `experts_kernel: auto`; FP8 too)
             GatheredExperts     batched matmuls over gathered weights (dtypes grouped GEMM lacks)
The same expert backend runs the local experts of routed rows on every rank (`routed`): P's
received rows, D's fixed receive slots, a single rank's top-k rows.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import ops
from ..protocol.config import KernelPicks


def torch_prologue(q, k, v, q_weight, k_weight, eps: float, cos, sin, k_cache, v_cache, slot_mapping):
    """Qwen3's per-head q/k RMSNorm, RoPE, and the KV write: the reference ops, in transformers' order."""
    q = ops.apply_rope(ops.rms_norm(q, q_weight, eps), cos, sin)
    k = ops.apply_rope(ops.rms_norm(k, k_weight, eps), cos, sin)
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    return q


class ReferenceAttention:
    needs_block_tables = False
    prefill = "reference"   # ops.paged_attention per sequence, P and D alike
    prologue = staticmethod(torch_prologue)

    def __call__(self, q, k_cache, v_cache, batch, scale: float):
        return ops.paged_attention(q, k_cache, v_cache, batch.seqs, scale)


class PagedAttention:
    needs_block_tables = True

    def __init__(self, prologue: str = "torch", kv_splits: int | str = 1, prefill: str = "sdpa",
                 prefill_splits: int | str = "auto"):
        self.kv_splits = kv_splits   # decode attention split along the context (kernels.py)
        self.prefill = prefill       # sdpa per segment (kernels.py) or one paged launch (paged_prefill.py)
        self.prefill_splits = None if prefill_splits == "auto" else prefill_splits   # the launch's walks
        if prologue == "fused":
            from .prologue import qk_prologue
            self.prologue = qk_prologue
        else:
            self.prologue = torch_prologue

    def __call__(self, q, k_cache, v_cache, batch, scale: float):
        from . import kernels
        nd = batch.num_decode
        o = torch.empty_like(q)
        if nd:
            kernels.decode_attention(q[:nd], k_cache, v_cache, batch.block_tables, batch.seq_lens,
                                     batch.block_size, scale, kv_splits=self.kv_splits, out=o[:nd])
        segments = batch.seqs[nd:]
        if segments and self.prefill in ("triton", "hybrid"):
            from . import paged_prefill
            if batch.prefill_plan is None:   # the same segments in every layer: one plan a step
                batch.prefill_plan = SDPA if self.prefill == "hybrid" and sdpa_wins(segments) \
                    else paged_prefill.plan_tiles(segments, q.device, heads=q.shape[1],
                                                 splits=self.prefill_splits)
            if batch.prefill_plan is not SDPA:
                paged_prefill.paged_prefill_attention(q, k_cache, v_cache, segments, scale, out=o,
                                                      plan=batch.prefill_plan)
                return o
            if q.device.type != "cuda" or q.dtype in (torch.bfloat16, torch.float16):   # cuDNN's dtypes
                kernels.fresh_prefill_attention(q, k_cache, v_cache, segments, scale, out=o)
                return o
        if segments:
            kernels.prefill_attention(q, k_cache, v_cache, segments, scale, out=o)
        return o


SDPA = "sdpa"   # a step's prefill plan under `hybrid` when SDPA takes its segments
# Under `prefill_attention: hybrid`, segments this long and fresh go to SDPA on cuDNN with their
# lengths bucketed (kernels.fresh_prefill_attention), where they ran faster than on the paged launch;
# continuations and short segments stay on the launch. Steps of more fresh tokens than the cap stay
# on the launch too: the gain was measured up to the 8k chunk, and every shape under the cap is built
# at start, which grows fast past it (docs/PERF.md, "Kernel choices").
SDPA_FRESH_MIN_TOKENS = 2048
SDPA_FRESH_MAX_TOKENS = 8192


def sdpa_wins(segments) -> bool:
    """Every P segment a fresh prompt (no cached context) of at least SDPA_FRESH_MIN_TOKENS, and
    at most SDPA_FRESH_MAX_TOKENS of them in the step."""
    return all(s.q_len == s.ctx_len and s.q_len >= SDPA_FRESH_MIN_TOKENS for s in segments) \
        and sum(s.q_len for s in segments) <= SDPA_FRESH_MAX_TOKENS


class _Experts:
    fn = staticmethod(ops.experts_reference)
    fp8_in_kernel = False   # takes e4m3 expert weights and their block scales as they are (`fp8=`)

    def __call__(self, x, topk_ids, topk_weights, gate_up, down, expert_offset: int = 0, **fp8):
        if x.shape[0] == 0:   # a rank may receive no rows this step (the shapes below need some)
            return x.new_zeros(0, down.shape[1])
        return self.fn(x, topk_ids, topk_weights, gate_up, down, expert_offset, **fp8)

    def routed(self, rows, local_ids, gate_up, down, **fp8):
        """Each row through its one local expert (id -1: an empty slot, output 0): what an expert
        all-to-all delivers. No host read, so D can run it inside a graph."""
        one = local_ids[:, None]
        dtype = rows.dtype if fp8 else gate_up.dtype    # FP8 weights: the activations' dtype
        weight = torch.ones(one.shape, dtype=dtype, device=rows.device)
        return self(rows.to(dtype), one, weight, gate_up, down, **fp8)


class ReferenceExperts(_Experts):
    pass


class GroupedExperts(_Experts):
    @property
    def fn(self):
        from . import kernels
        return kernels.experts_grouped


class FusedExperts(_Experts):
    fp8_in_kernel = True    # FP8 checkpoints: each weight tile dequantized in registers (fused_moe.py)

    @property
    def fn(self):
        from . import fused_moe
        return fused_moe.experts_fused


# AutoExperts' tiles by routed (token, expert) pairs, from e2e/gpu/moe_kernels.py's sweeps at the
# Qwen3-30B-A3B expert shape, where the fused kernels beat the grouped GEMMs at every size (figures in
# docs/PERF.md, "Kernel choices"). Tiles grow with the rows an expert sees: 16 rows at decode sizes (an
# expert gets a few rows) with 128-deep K steps for 16-bit weights; 32 rows from FUSED_32_PAIRS (vLLM's
# tuned H200 table switches there too); 64 from FUSED_MEDIUM_PAIRS (vLLM's: 64 at 512 tokens); 128 from
# FUSED_LARGE_PAIRS. fp32 weights (the exact paths) keep 64-deep K steps: twice the bytes a stage.
# Decided from shapes alone, so a captured graph keeps its choice.
FUSED_32_PAIRS = 2048
FUSED_MEDIUM_PAIRS = 4096
FUSED_LARGE_PAIRS = 8192
FUSED_SMALL_TILES = dict(block_k=128)      # on experts_fused's 16-row defaults
FUSED_32_TILES = dict(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=3, group_m=1)
FUSED_MEDIUM_TILES = dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4, group_m=1)
FUSED_LARGE_TILES = dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, group_m=8)


def fused_tiles(pairs: int, weight_bytes: int = 2) -> dict:
    """experts_fused's tile arguments for a layer of `pairs` routed pairs and weights of `weight_bytes`
    an element ({}: its 16-row defaults). Only 16-bit weights were swept at the 128-deep K steps."""
    if pairs >= FUSED_LARGE_PAIRS:
        return FUSED_LARGE_TILES
    if pairs >= FUSED_MEDIUM_PAIRS:
        return FUSED_MEDIUM_TILES
    if weight_bytes != 2:   # FP8 and fp32 keep the tiers they were measured on
        return FUSED_MEDIUM_TILES if pairs >= FUSED_32_PAIRS else {}
    return FUSED_32_TILES if pairs >= FUSED_32_PAIRS else FUSED_SMALL_TILES


def fused_regime_tokens(top_k: int) -> tuple[int, ...]:
    """The fewest tokens of each (tile tier, pair layout) regime `AutoExperts` runs, for the prefill
    warm-up: each regime is its own compile of the kernels, and the sizes within one are not
    specialized, so once each has run, no step compiles (runtime/jit_watch.py). The regime is constant
    between these boundaries of the pairs, so their starts meet each one."""
    from .fused_moe import ALIGN_KERNEL_MAX_PAIRS, DIRECT_MAX_PAIRS
    pairs = (1, DIRECT_MAX_PAIRS + 1, FUSED_32_PAIRS, FUSED_MEDIUM_PAIRS, FUSED_LARGE_PAIRS, ALIGN_KERNEL_MAX_PAIRS + 1)
    return tuple(sorted({-(-p // top_k) for p in pairs}))


class AutoExperts(_Experts):
    # FP8 experts too: each weight tile dequantized in registers (the grouped GEMMs would need the
    # layer's experts dequantized each forward, an order of magnitude slower: docs/PERF.md)
    fp8_in_kernel = True

    def fn(self, x, topk_ids, topk_weights, gate_up, down, expert_offset: int = 0, fp8=None):
        from . import fused_moe
        tiles = fused_tiles(topk_ids.numel(), gate_up.element_size())
        return fused_moe.experts_fused(x, topk_ids, topk_weights, gate_up, down, expert_offset, **tiles, fp8=fp8)


class GatheredExperts(_Experts):
    @property
    def fn(self):
        from . import kernels
        return kernels.experts_gathered


@dataclass(frozen=True)
class Backends:
    attention: object
    experts: object
    add_norm: object = None     # (x, y|None, weight, eps) -> (x+y, rms_norm(x+y)); None: the torch ops
    router: object = None       # (logits, top_k, norm, dtype) -> (weights, ids); None: ops.route

    def residual_norm(self, x, y, weight, eps: float):
        from . import norms
        return (self.add_norm or norms.torch_add_norm)(x, y, weight, eps)

    def route(self, router_logits, top_k: int, norm_topk_prob: bool, dtype: torch.dtype, live=None):
        return (self.router or ops.route)(router_logits, top_k, norm_topk_prob, dtype, live)

    @property
    def name(self) -> str:
        norm = "+FusedAddNorm" if self.add_norm is not None else ""
        router = "+FusedRouter" if self.router is not None else ""
        return f"{type(self.attention).__name__}+{type(self.experts).__name__}{norm}{router}"


def make_backends(device: torch.device, dtype: torch.dtype, picks: KernelPicks = KernelPicks()) -> Backends:
    """The kernels of `picks` (protocol/config.KernelPicks; an EngineConfig is one) on this device.
    CPU always runs the reference. Auto picks the fused kernels only in bf16: fp32 on CUDA stays on
    the exact paths (gathered experts; the torch prologue, add + norm and routing)."""
    if device.type != "cuda":
        return Backends(ReferenceAttention(), ReferenceExperts())
    bf16 = dtype == torch.bfloat16
    prologue, add_norm, router = (("fused" if bf16 else "torch") if k == "auto" else k
                                  for k in (picks.qk_prologue, picks.add_norm, picks.router))
    prefill = prefill_kernel(picks.prefill_attention, dtype, torch.cuda.get_device_capability(device),
                             torch.backends.cudnn.is_available())
    attention = PagedAttention(prologue, picks.decode_kv_splits, prefill, picks.prefill_kv_splits)
    backends = _cuda_backends(device, dtype, picks.experts_kernel, attention)
    if add_norm == "fused":
        from .norms import fused_add_norm
        backends = replace(backends, add_norm=fused_add_norm)
    if router == "fused":
        from .router import fused_route
        backends = replace(backends, router=fused_route)
    return backends


def prefill_kernel(setting: str, dtype: torch.dtype, capability: tuple[int, int] = (9, 0),
                   cudnn: bool = True) -> str:
    """EngineConfig.prefill_attention on CUDA. auto in bf16: `hybrid` where it was measured (SM90+ with
    cuDNN: the paged launch, and cuDNN for steps of long fresh prompts, faster there: docs/PERF.md),
    else the launch (`triton`); other dtypes: SDPA per segment (the launch is bf16 only; fp32 stays
    on the exact path)."""
    if setting != "auto":
        return setting
    if dtype != torch.bfloat16:
        return "sdpa"
    return "hybrid" if capability >= (9, 0) and cudnn else "triton"


def _cuda_backends(device: torch.device, dtype: torch.dtype, experts: str, attention: PagedAttention) -> Backends:
    if experts == "fused":
        return Backends(attention, FusedExperts())
    grouped = dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    if experts == "grouped" and not grouped:
        raise ValueError(f"experts_kernel 'grouped' needs bf16 on SM90+ (have {dtype}, "
                         f"SM{''.join(map(str, torch.cuda.get_device_capability(device)))})")
    if not grouped:
        return Backends(attention, GatheredExperts())
    return Backends(attention, AutoExperts() if experts == "auto" else GroupedExperts())


REFERENCE = Backends(ReferenceAttention(), ReferenceExperts())
