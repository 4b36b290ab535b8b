"""Reference tensor ops shared by every path. The CPU path runs exactly these; CUDA kernels
(engine/kernels) are tested against them."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as transformers' Qwen3MoeRMSNorm: normalize in fp32, scale in the input dtype.
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rope_inv_freq(theta: float, head_dim: int, device=None) -> torch.Tensor:
    """RoPE's inverse frequencies, on `device` (the default device if None). Computed on the CPU:
    under a meta-device context arange runs a Python kernel that imports torch._dynamo."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
    return inv.to(torch.get_default_device() if device is None else device)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    seqs: list, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole context in the paged cache.

    q: [T, H, D] (all sequences' new tokens, concatenated); k/v_cache: [slots, KVH, D];
    seqs: objects with q_start, q_len, ctx_len and slots (LongTensor[ctx_len]: cache slot of each
    context position). Returns [T, H, D].
    """
    out = torch.empty_like(q)
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    for s in seqs:
        qs = q[s.q_start:s.q_start + s.q_len].transpose(0, 1)          # [H, q, D]
        k = k_cache.index_select(0, s.slots).transpose(0, 1)           # [KVH, ctx, D]
        v = v_cache.index_select(0, s.slots).transpose(0, 1)
        if kv_heads != heads:
            k = k.repeat_interleave(heads // kv_heads, dim=0)
            v = v.repeat_interleave(heads // kv_heads, dim=0)
        # Query i sits at context position ctx_len - q_len + i and sees keys 0..that position.
        first = s.ctx_len - s.q_len
        qpos = torch.arange(first, s.ctx_len, device=q.device)[:, None]
        kpos = torch.arange(s.ctx_len, device=q.device)[None, :]
        mask = kpos <= qpos
        o = F.scaled_dot_product_attention(qs.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                           attn_mask=mask, scale=scale)
        out[s.q_start:s.q_start + s.q_len] = o.squeeze(0).transpose(0, 1)
    return out


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool, dtype: torch.dtype,
          live: torch.Tensor | None = None):
    """Softmax over experts in fp32, top-k, optional renormalization (Qwen3-MoE routing). `live`: one
    count per row (a decode graph's seq_lens); a row at 0 is padding: ids -1 (no expert), weights 0."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if live is not None:
        keep = (live > 0)[:, None]
        weights, ids = torch.where(keep, weights, 0.0), torch.where(keep, ids, -1)
    return weights.to(dtype), ids


def experts_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor, expert_offset: int = 0) -> torch.Tensor:
    """Routed SwiGLU experts, one expert at a time. gate_up: [E, 2I, H]; down: [E, H, I].

    `expert_offset` maps global expert ids onto this shard's local weights; ids outside the
    shard contribute nothing (another rank owns them).
    """
    out = torch.zeros_like(x)
    local = topk_ids - expert_offset
    num_local = gate_up.shape[0]
    for e in torch.unique(local).tolist():
        if e < 0 or e >= num_local:
            continue
        tok, slot = torch.where(local == e)
        h = F.linear(x[tok], gate_up[e])
        gate, up = h.chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e])
        out.index_add_(0, tok, y * topk_weights[tok, slot, None])
    return out


def swiglu_mlp(x, gate_w, up_w, down_w):
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)
