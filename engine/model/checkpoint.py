"""Random-weight Qwen3-MoE checkpoints in Hugging Face format (config.json + safetensors).

Weights are scaled so activations stay O(1) through depth and logits are well separated, which
keeps greedy decoding stable enough to compare token-for-token with a reference implementation.
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Iterator, Literal

import torch
from safetensors.torch import save_file

from ..protocol.config import ModelConfig

Layout = Literal["per-expert", "fused"]
SHARD_BYTES = 4 << 30


def random_tensors(cfg: ModelConfig, seed: int, dtype: torch.dtype,
                   layout: Layout = "per-expert") -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (checkpoint key, tensor) in a fixed order, deterministic by seed."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    def norm_weight(dim):
        return (1.0 + 0.1 * torch.randn(dim, generator=g)).to(dtype)

    h, d = cfg.hidden_size, cfg.head_dim
    yield "model.embed_tokens.weight", normal(cfg.vocab_size, h, std=1.0)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", norm_weight(h)
        yield p + "post_attention_layernorm.weight", norm_weight(h)
        yield p + "self_attn.q_proj.weight", normal(cfg.num_attention_heads * d, h, std=h ** -0.5)
        yield p + "self_attn.k_proj.weight", normal(cfg.num_key_value_heads * d, h, std=h ** -0.5)
        yield p + "self_attn.v_proj.weight", normal(cfg.num_key_value_heads * d, h, std=h ** -0.5)
        yield p + "self_attn.o_proj.weight", normal(h, cfg.num_attention_heads * d,
                                                    std=(cfg.num_attention_heads * d) ** -0.5)
        if cfg.attention_bias:
            for n, rows in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads),
                            ("v", cfg.num_key_value_heads)):
                yield p + f"self_attn.{n}_proj.bias", normal(rows * d, std=0.1)
        yield p + "self_attn.q_norm.weight", norm_weight(d)
        yield p + "self_attn.k_norm.weight", norm_weight(d)
        if cfg.is_moe_layer(i):
            e, inter = cfg.num_experts, cfg.moe_intermediate_size
            yield p + "mlp.gate.weight", normal(e, h, std=2.0 * h ** -0.5)
            gate_up = normal(e, 2 * inter, h, std=h ** -0.5)
            down = normal(e, h, inter, std=inter ** -0.5)
            if layout == "fused":
                yield p + "mlp.experts.gate_up_proj", gate_up
                yield p + "mlp.experts.down_proj", down
            else:
                for x in range(e):
                    yield p + f"mlp.experts.{x}.gate_proj.weight", gate_up[x, :inter].clone()
                    yield p + f"mlp.experts.{x}.up_proj.weight", gate_up[x, inter:].clone()
                    yield p + f"mlp.experts.{x}.down_proj.weight", down[x].clone()
        else:
            inter = cfg.intermediate_size
            yield p + "mlp.gate_proj.weight", normal(inter, h, std=h ** -0.5)
            yield p + "mlp.up_proj.weight", normal(inter, h, std=h ** -0.5)
            yield p + "mlp.down_proj.weight", normal(h, inter, std=inter ** -0.5)
    yield "model.norm.weight", norm_weight(h)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", normal(cfg.vocab_size, h, std=2.0 * h ** -0.5)


def write_checkpoint(config: dict, out: str | Path, *, seed: int = 0, dtype: str = "float32",
                     layout: Layout = "per-expert") -> Path:
    """Writes config.json and safetensors shards (with an index when there is more than one)."""
    cfg = ModelConfig.from_dict(config)
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in random_tensors(cfg, seed, tdtype, layout):
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = t.contiguous()
        size += nbytes
    weight_map = {}
    for n, tensors in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    full = dict(config)
    full.setdefault("model_type", "qwen3_moe")
    full.setdefault("architectures", ["Qwen3MoeForCausalLM"])
    full["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(full, indent=2))
    return out


def _init_std(name: str, shape) -> float:
    if name == "model.embed_tokens.weight":
        return 1.0
    if name in ("lm_head.weight",) or name.endswith("mlp.gate.weight"):
        return 2.0 * shape[-1] ** -0.5
    if name.endswith(".bias"):
        return 0.1
    return shape[-1] ** -0.5          # fan-in scaling keeps activations O(1) through depth


@torch.no_grad()
def random_model(cfg: ModelConfig, device, dtype: torch.dtype, seed: int = 0, shard=None, collectives=None,
                 backends=None):
    """Builds the model directly on `device` with random weights of the same scales as
    `random_tensors` (other values): a 30B-parameter benchmark model needs no checkpoint on disk."""
    from .backends import REFERENCE
    from .qwen3_moe import Qwen3MoeModel, Shard
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = Qwen3MoeModel(cfg, shard or Shard(), collectives, backends or REFERENCE)
        with torch.device("meta"):   # full shapes: which tensors this shard splits
            full = {n: p.shape for n, p in Qwen3MoeModel(cfg, Shard(), None).named_parameters()}
    finally:
        torch.set_default_dtype(prev)
    shard = shard or Shard()
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device)
    for name, p in model.named_parameters():
        # Seeded per name, so a replicated tensor is the same on every rank of a sharded model;
        # a split tensor also by the shard's coordinates, so two ranks' slices differ.
        key = name if p.shape == full[name] else \
            f"{name}@{shard.atp_rank}/{shard.atp_size}:{shard.ep_rank}/{shard.ep_size}"
        gen.manual_seed(seed ^ zlib.crc32(key.encode()))
        if name.endswith("norm.weight"):
            p.normal_(1.0, 0.1, generator=gen)
        else:
            p.normal_(0.0, _init_std(name, p.shape), generator=gen)
    model.tie_weights_if_needed()
    d = cfg.head_dim
    model.inv_freq = (1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))).to(device)
    return model
