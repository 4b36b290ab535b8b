"""Qwen3-MoE over a paged KV cache. One forward takes a flat batch of tokens from any mix of
prefill segments and decode rows (the same code serves P, D and fused steps).

Parameter names equal the Hugging Face checkpoint keys, so `state_dict()` is the fused layout.
Sharding seams for the distributed engine: attention heads (`Shard.atp_*`) and experts
(`Shard.ep_*`), with the cross-rank reductions supplied by a `Collectives` object.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import fp8, ops
from ..protocol.config import ModelConfig
from ..protocol.plan import Phase
from .backends import REFERENCE, Backends


@dataclass
class SeqSlice:
    """One sequence's rows in a flat batch."""
    q_start: int
    q_len: int
    ctx_len: int           # tokens in context after this step (cached + new)
    slots: torch.Tensor    # cache slot of each context position, LongTensor[ctx_len]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor       # [T]
    positions: torch.Tensor       # [T]
    slot_mapping: torch.Tensor    # [T] where each new token's K/V goes
    seqs: list[SeqSlice]
    logits_indices: torch.Tensor  # [S] rows whose next-token logits are wanted
    phase: Phase = Phase.MIXED    # passed down to the collectives (which path) and the expert comm
    # The first num_decode rows are decode rows (one token each); the rest prefill segments.
    # Block tables and lengths of the decode rows, for attention backends (a CUDA graph can hold them).
    num_decode: int = 0
    block_tables: torch.Tensor | None = None   # int32 [num_decode, max_blocks]
    seq_lens: torch.Tensor | None = None       # int32 [num_decode]
    block_size: int = 16
    routes: list | None = None   # when a list: each MoE layer appends its top-k ids [T, k] (routing replay)
    want_hidden: bool = False    # keep every row's final hidden state in `hidden` (the MTP proposer's input)
    hidden: torch.Tensor | None = None
    prefill_plan: object = None  # the attention backend's metadata of the prefill segments (built once a step)
    # int32 [T]: 0 marks a graph's padding row (routed to no expert, MoEBlock._padding); None: all real
    live: torch.Tensor | None = None


@dataclass(frozen=True)
class Shard:
    """Which part of the weights this rank holds. Defaults: the whole model."""
    atp_rank: int = 0
    atp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1


class Collectives:
    """Cross-rank reductions the model needs; identity on one rank."""

    def attn_reduce(self, x: torch.Tensor, phase: Phase) -> torch.Tensor:
        return x

    def experts(self, layer: "MoEBlock", x, topk_ids, topk_weights, phase: Phase) -> torch.Tensor:
        return layer.local_experts(x, topk_ids, topk_weights)


def _param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, backends: Backends):
        super().__init__()
        self.backends = backends
        if cfg.num_attention_heads % shard.atp_size or cfg.num_key_value_heads % shard.atp_size:
            raise ValueError(f"attention heads ({cfg.num_attention_heads} q, {cfg.num_key_value_heads} kv) "
                             f"do not divide over ATP={shard.atp_size}")
        self.heads = cfg.num_attention_heads // shard.atp_size
        self.kv_heads = cfg.num_key_value_heads // shard.atp_size
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        h, d, blk = cfg.hidden_size, cfg.head_dim, cfg.fp8_block
        self.q_proj = fp8.make_linear(h, self.heads * d, blk, bias=cfg.attention_bias)
        self.k_proj = fp8.make_linear(h, self.kv_heads * d, blk, bias=cfg.attention_bias)
        self.v_proj = fp8.make_linear(h, self.kv_heads * d, blk, bias=cfg.attention_bias)
        self.o_proj = fp8.make_linear(self.heads * d, h, blk, bias=False)
        self.q_norm = RMSNorm(d, self.eps)
        self.k_norm = RMSNorm(d, self.eps)

    def fuse_qkv(self) -> bool:
        """q, k and v as row blocks of one weight: one GEMM a layer instead of three (at decode the
        three launches took ~3× their read). The parameters keep their checkpoint names and become
        views of it, so in-place loads and weight updates reach the fused weight; whatever gives a
        parameter new storage (memory release/resume) ends the fusion until this runs again, and
        until then the forward takes the three GEMMs (`_qkv_weight`). bf16/fp32 without bias only."""
        if not self._plain_qkv():
            return False
        lins = (self.q_proj, self.k_proj, self.v_proj)
        fused = torch.cat([m.weight.data for m in lins])
        at = 0
        for m in lins:
            n = m.weight.shape[0]
            m.weight.data = fused[at:at + n]
            at += n
        return True

    def _plain_qkv(self) -> bool:
        """q, k and v are loaded bf16/fp32 linears without bias: what one GEMM can stand for."""
        return all(type(m) is nn.Linear and m.bias is None and m.weight.numel() > 0
                   for m in (self.q_proj, self.k_proj, self.v_proj))

    def _qkv_weight(self) -> torch.Tensor | None:
        """The fused weight while q, k and v lie back to back in one storage, else None."""
        if not self._plain_qkv():
            return None
        q, k, v = self.q_proj.weight, self.k_proj.weight, self.v_proj.weight
        row = q.shape[1] * q.element_size()
        if k.data_ptr() != q.data_ptr() + q.shape[0] * row or v.data_ptr() != k.data_ptr() + k.shape[0] * row \
                or not q.is_contiguous() or q.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
            return None
        return q.as_strided((q.shape[0] + k.shape[0] + v.shape[0], q.shape[1]), (q.shape[1], 1))

    def project(self, x, cos, sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
        """q/k/v, their norms and RoPE, this step's K/V written to the cache: the rows' queries
        [t, heads, head_dim]. Reads no batch metadata but the slots, so a graph can hold it."""
        t = x.shape[0]
        qkv = self._qkv_weight()
        if qkv is not None:
            q, k, v = F.linear(x, qkv).split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                                               self.kv_heads * self.head_dim], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.heads, self.head_dim)
        k = k.view(t, self.kv_heads, self.head_dim)
        v = v.view(t, self.kv_heads, self.head_dim)
        # q/k norm, RoPE, the KV write (backends.py: the torch ops, or one fused kernel per operand)
        return self.backends.attention.prologue(q, k, v, self.q_norm.weight, self.k_norm.weight, self.eps, cos, sin,
                                                k_cache, v_cache, slot_mapping)

    def out(self, o) -> torch.Tensor:
        """o_proj (FP8 checkpoints: Fp8Linear)."""
        return self.o_proj(o)

    def attend(self, q, k_cache, v_cache, batch: ForwardBatch) -> torch.Tensor:
        """The attention of q over the paged cache: [t, heads × head_dim], before o_proj. Reads the
        batch's segments and tables: the step-shaped part of a layer."""
        o = self.backends.attention(q, k_cache, v_cache, batch, self.head_dim ** -0.5)
        return o.reshape(q.shape[0], self.heads * self.head_dim)   # t may be 0 on a rank


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, block: tuple[int, int] | None = None):
        super().__init__()
        self.gate_proj = fp8.make_linear(hidden, inter, block)
        self.up_proj = fp8.make_linear(hidden, inter, block)
        self.down_proj = fp8.make_linear(inter, hidden, block)

    def forward(self, x, batch, collectives):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """A shard's experts, fused: gate_up [E, 2I, H], down [E, H, I]. With an FP8 block they are
    e4m3 with float32 scales per block (`*_scale_inv`; gate_up's scale holds gate's block rows,
    then up's, as the checkpoint quantizes them separately)."""

    def __init__(self, num_local: int, hidden: int, inter: int, block: tuple[int, int] | None = None):
        super().__init__()
        self.inter, self.block = inter, block
        if block is None:
            self.gate_up_proj = _param(num_local, 2 * inter, hidden)
            self.down_proj = _param(num_local, hidden, inter)
            return
        ni, nh = fp8.scale_shape(inter, hidden, block)
        self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * inter, hidden, dtype=fp8.FP8), requires_grad=False)
        self.gate_up_proj_scale_inv = nn.Parameter(torch.empty(num_local, 2 * ni, nh, dtype=torch.float32),
                                                   requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_local, hidden, inter, dtype=fp8.FP8), requires_grad=False)
        self.down_proj_scale_inv = nn.Parameter(torch.empty(num_local, nh, ni, dtype=torch.float32),
                                                requires_grad=False)

    def weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert e's (gate_up, down) for a matmul in `dtype` (dequantized when FP8)."""
        if self.block is None:
            return self.gate_up_proj[e], self.down_proj[e]
        return fp8.expert_weights(self, e, dtype)


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = _param(num_experts, hidden)


# A decode graph's padding rows route to no expert (MoEBlock._padding); False: as real rows (the A/B
# of e2e/gpu/padding_routes.py)
SKIP_PADDING_ROUTES = True
# The same for P's piecewise graphs' padding (runtime/prefill_graphs.py: stale tokens); apart from
# decode's so that e2e/gpu/padding_routes.py --p-shapes can A/B it
SKIP_P_PADDING_ROUTES = True


class MoEBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, backends: Backends):
        super().__init__()
        self.backends = backends
        if cfg.num_experts % shard.ep_size:
            raise ValueError(f"{cfg.num_experts} experts do not divide over EP={shard.ep_size}")
        self.num_local = cfg.num_experts // shard.ep_size
        self.expert_offset = shard.ep_rank * self.num_local
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = Router(cfg.num_experts, cfg.hidden_size)
        self.experts = Experts(self.num_local, cfg.hidden_size, cfg.moe_intermediate_size, cfg.fp8_block)

    def local_experts(self, x, topk_ids, topk_weights):
        """This shard's experts for rows routed by global expert id (foreign experts add nothing)."""
        e = self.experts
        if self._fp8_in_kernel():
            return self.backends.experts(x, topk_ids, topk_weights, e.gate_up_proj, e.down_proj,
                                         self.expert_offset, fp8=self._fp8_scales())
        if e.block is not None and not x.is_cuda:   # FP8: dequantized per routed expert (fp8.py)
            return fp8.experts_forward(x, topk_ids, topk_weights, e, self.expert_offset)
        gate_up, down = self._expert_tensors(x.dtype)
        return self.backends.experts(x, topk_ids, topk_weights, gate_up, down, self.expert_offset)

    def _fp8_in_kernel(self) -> bool:
        """FP8 experts handed to a kernel that dequantizes tiles itself (the fused Triton MoE)."""
        return self.experts.block is not None and self.backends.experts.fp8_in_kernel

    def _fp8_scales(self):
        e = self.experts
        return e.gate_up_proj_scale_inv, e.down_proj_scale_inv, e.block

    def _expert_tensors(self, dtype):
        """The expert backend's weights. FP8 on CUDA: the layer's local experts dequantized for this
        forward (transient; shapes fixed, no host read, so decode graphs can hold it), then the
        usual grouped GEMM; fp8.experts_forward's per-expert loop reads the host."""
        if self.experts.block is None:
            return self.experts.gate_up_proj, self.experts.down_proj
        return fp8.expert_weights(self.experts, slice(None), dtype)

    def routed_experts(self, rows, local_ids):
        """Each row through its one local expert (-1: empty, output 0): what an all-to-all delivers."""
        if self._fp8_in_kernel():
            e = self.experts
            return self.backends.experts.routed(rows, local_ids, e.gate_up_proj, e.down_proj, fp8=self._fp8_scales())
        if self.experts.block is not None and not rows.is_cuda:
            ones = torch.ones(local_ids.shape[0], 1, dtype=rows.dtype, device=rows.device)
            return fp8.experts_forward(rows, local_ids[:, None], ones, self.experts)
        return self.backends.experts.routed(rows, local_ids, *self._expert_tensors(rows.dtype))

    def _padding(self, x, batch) -> torch.Tensor | None:
        """A graph's live rows (`batch.live`): its padding rows (a decode graph's token 0 in every
        one, all routed alike; P's pieces' stale tokens) would read experts the real rows need not;
        routed to none they are skipped. One rank's experts only (EP1): an all-to-all's senders
        take ids of real experts."""
        on = SKIP_PADDING_ROUTES if batch.phase is Phase.DECODE else SKIP_P_PADDING_ROUTES
        if not on or batch.live is None or self.num_local != self.gate.weight.shape[0] \
                or batch.live.shape[0] != x.shape[0]:
            return None
        return batch.live

    def forward(self, x, batch, collectives: Collectives):
        weights, ids = self.backends.route(F.linear(x, self.gate.weight), self.top_k, self.norm_topk_prob,
                                           x.dtype, self._padding(x, batch))
        if batch.routes is not None:
            batch.routes.append(ids)
        return collectives.experts(self, x, ids, weights, batch.phase)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, shard: Shard, backends: Backends):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, shard, backends)
        self.is_moe = cfg.is_moe_layer(idx)
        self.mlp = MoEBlock(cfg, shard, backends) if self.is_moe else DenseMLP(cfg.hidden_size, cfg.intermediate_size,
                                                                                     cfg.fp8_block)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, backends: Backends, layers: int):
        super().__init__()
        # Given its weight, Embedding skips its init (normal_ on meta imports torch._dynamo, seconds).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, shard, backends) for i in range(layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPHead(nn.Module):
    """Qwen3-Next's multi-token-prediction module (checkpoint keys `mtp.*`) over this model's own
    layer kind: fc(concat(norm(embed(token i+1)), norm(hidden i))) -> decoder layers -> norm; the
    embedding and lm_head are the target's. It predicts token i+2."""

    def __init__(self, cfg: ModelConfig, shard: Shard, backends: Backends):
        super().__init__()
        h = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        # layer index past the target's: MoE unless decoder_sparse_step / mlp_only_layers say otherwise
        self.layers = nn.ModuleList(DecoderLayer(cfg, cfg.num_hidden_layers + j, shard, backends)
                                    for j in range(cfg.num_nextn_predict_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard = Shard(), collectives: Collectives | None = None,
                 backends: Backends = REFERENCE, mtp: bool = False, head_only: bool = False):
        """`head_only`: the MTP head, embedding and lm_head, no target layers (runtime/mtp.py)."""
        super().__init__()
        if head_only and not (mtp and cfg.num_nextn_predict_layers):
            raise ValueError("head_only builds the MTP head: needs mtp and config num_nextn_predict_layers")
        self.cfg = cfg
        self.shard = shard
        self.collectives = collectives or Collectives()
        self.backends = backends
        self.model = Backbone(cfg, shard, backends, 0 if head_only else cfg.num_hidden_layers)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # built only for --speculative mtp: otherwise a checkpoint's mtp.* tensors are not loaded
        self.mtp = MTPHead(cfg, shard, backends) if mtp and cfg.num_nextn_predict_layers else None
        for p in self.parameters():
            p.requires_grad_(False)
        self.register_buffer("inv_freq", ops.rope_inv_freq(cfg.rope_theta, cfg.head_dim), persistent=False)

    def fuse_projections(self) -> int:
        """Every attention layer's q/k/v as one weight (Attention.fuse_qkv), after loading and after a
        memory resume; returns how many were fused."""
        return sum(m.fuse_qkv() for m in self.modules() if isinstance(m, Attention))

    def materialize(self, device) -> "Qwen3MoeModel":
        """A meta-built model's weights allocated, uninitialized, and RoPE's frequencies computed on
        `device` (Module.to_empty's empty_like on meta inputs imports torch's symbolic shapes)."""
        self._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
        self.inv_freq = ops.rope_inv_freq(self.cfg.rope_theta, self.cfg.head_dim, device)
        return self

    def tie_weights_if_needed(self):
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv) -> torch.Tensor:
        """Returns fp32 logits for `batch.logits_indices` rows: [S, vocab]."""
        x, cos, sin = self.embed(batch.input_ids, batch.positions)
        return self.logits(self._layers(self.model.layers, x, cos, sin, kv, batch), batch)

    def embed(self, input_ids, positions):
        """The residual stream's start and the rows' RoPE tables."""
        x = self.model.embed_tokens(input_ids)
        return (x, *ops.rope_cos_sin(positions, self.inv_freq, x.dtype))

    def logits(self, x, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits of `batch.logits_indices` rows from the last layer's residual stream x."""
        if batch.want_hidden:   # after the final norm: what vLLM's Qwen3-Next MTP is fed (docs/ARCHITECTURE.md)
            batch.hidden = self.model.norm(x)
            x = batch.hidden.index_select(0, batch.logits_indices)
        else:
            x = self.model.norm(x.index_select(0, batch.logits_indices))
        return self.lm_head(x).float()

    @torch.inference_mode()
    def mtp_forward(self, batch: ForwardBatch, kv, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP head (one rank, its own KV `kv`): row j of `batch` holds token i+1 at position i and
        `hidden` row j the hidden state at position i. Returns (fp32 logits of token i+2, the head's
        final hidden state) for `batch.logits_indices` rows; that hidden state stands in for the
        target's when the head is chained on its own draft."""
        m = self.mtp
        e = m.pre_fc_norm_embedding(self.model.embed_tokens(batch.input_ids))
        x = m.fc(torch.cat([e, m.pre_fc_norm_hidden(hidden)], dim=-1))
        cos, sin = ops.rope_cos_sin(batch.positions, self.inv_freq, x.dtype)
        x = m.norm(self._layers(m.layers, x, cos, sin, kv, batch).index_select(0, batch.logits_indices))
        return self.lm_head(x).float(), x

    def _layers(self, layers, x, cos, sin, kv, batch: ForwardBatch) -> torch.Tensor:
        """Decoder layers over residual stream x (layer i's KV in kv.k[i], kv.v[i]); before the final
        norm. Cut at each attention (project | attend | after_attention): the pieces a graph of the
        P forward holds (runtime/prefill_graphs.py) are exactly these calls."""
        x, h = self.enter(layers, x)
        for i, layer in enumerate(layers):
            q = layer.self_attn.project(h, cos, sin, kv.k[i], kv.v[i], batch.slot_mapping)
            x, h = self.after_attention(layers, i, x, layer.self_attn.attend(q, kv.k[i], kv.v[i], batch), batch)
        return x

    def enter(self, layers, x):
        """(x, the first layer's normed input)."""
        ln = layers[0].input_layernorm
        return self.backends.residual_norm(x, None, ln.weight, ln.eps)

    def after_attention(self, layers, i: int, x, o, batch: ForwardBatch):
        """Layer i from its attention output o on: o_proj, residual add + norm, the MLP, then the next
        layer's input norm: (x, its normed input); after the last layer (x + MLP out, None)."""
        col, layer = self.collectives, layers[i]
        # each residual add and the norm after it are one call (backends.add_norm may fuse them)
        norm = self.backends.residual_norm
        ln = layer.post_attention_layernorm
        x, h = norm(x, col.attn_reduce(layer.self_attn.out(o), batch.phase), ln.weight, ln.eps)
        h = layer.mlp(h, batch, col)
        if i + 1 < len(layers):
            ln = layers[i + 1].input_layernorm
            return norm(x, h, ln.weight, ln.eps)
        return x + h, None
