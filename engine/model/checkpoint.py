"""Random-weight Qwen3-MoE checkpoints in Hugging Face format (config.json + safetensors).

`dtype="fp8"` writes the block-FP8 layout of Hugging Face FP8 releases (fp8.py; config.json gets
`quantization_config`), and `write_dequantized` the same model with every FP8 weight dequantized:
its twin, for comparisons.

Weights are scaled so activations stay O(1) through depth and logits are well separated, which
keeps greedy decoding stable enough to compare token-for-token with a reference implementation.
"""
from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path
from typing import Iterator, Literal

import torch
from safetensors.torch import save_file

from ..protocol.config import FP8_BLOCK, ModelConfig
from . import fp8

Layout = Literal["per-expert", "fused"]
SHARD_BYTES = 4 << 30
# The linears an FP8 release quantizes; embeddings, norms, the router (mlp.gate) and lm_head stay bf16.
FP8_KEYS = re.compile(r"^(model|mtp)\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight$")
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(FP8_BLOCK)}


def random_tensors(cfg: ModelConfig, seed: int, dtype: torch.dtype,
                   layout: Layout = "per-expert") -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (checkpoint key, tensor) in a fixed order, deterministic by seed."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    def norm_weight(dim):
        return (1.0 + 0.1 * torch.randn(dim, generator=g)).to(dtype)

    h = cfg.hidden_size
    yield "model.embed_tokens.weight", normal(cfg.vocab_size, h, std=1.0)
    for i in range(cfg.num_hidden_layers):
        yield from _layer(cfg, i, f"model.layers.{i}.", normal, norm_weight, layout)
    yield "model.norm.weight", norm_weight(h)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", normal(cfg.vocab_size, h, std=2.0 * h ** -0.5)
    if cfg.num_nextn_predict_layers:   # last: the target's tensors are the same with or without them
        yield "mtp.pre_fc_norm_embedding.weight", norm_weight(h)
        yield "mtp.pre_fc_norm_hidden.weight", norm_weight(h)
        yield "mtp.fc.weight", normal(h, 2 * h, std=(2 * h) ** -0.5)
        for j in range(cfg.num_nextn_predict_layers):
            yield from _layer(cfg, cfg.num_hidden_layers + j, f"mtp.layers.{j}.", normal, norm_weight, layout)
        yield "mtp.norm.weight", norm_weight(h)


def _layer(cfg: ModelConfig, i: int, p: str, normal, norm_weight, layout: Layout):
    """One decoder layer's tensors under key prefix p (layer index i decides MoE or dense)."""
    h, d = cfg.hidden_size, cfg.head_dim
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


def _save(tensors, config: dict, out: Path, torch_dtype: str) -> Path:
    """config.json and safetensors shards (with an index when there is more than one)."""
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = t.contiguous()
        size += nbytes
    weight_map = {}
    for n, part in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(out / name), metadata={"format": "pt"})
        # safetensors writes owner-only (0600); a checkpoint is read by other users too (a
        # container's non-root engine reading an image's /models), so it gets what umask allows.
        os.chmod(out / name, _file_mode())
        weight_map.update({k: name for k in part})
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    full = dict(config)
    full.setdefault("model_type", "qwen3_moe")
    full.setdefault("architectures", ["Qwen3MoeForCausalLM"])
    full["torch_dtype"] = torch_dtype
    (out / "config.json").write_text(json.dumps(full, indent=2))
    return out


def quantized_tensors(tensors, block: tuple[int, int] = FP8_BLOCK, rest: torch.dtype = torch.bfloat16):
    """An FP8 release's tensors from full-precision ones: each quantized linear's weight as e4m3
    plus its `weight_scale_inv`, everything else in `rest`."""
    for key, t in tensors:
        if FP8_KEYS.match(key):
            q, scale = fp8.quantize(t, block)
            yield key, q
            yield key + "_scale_inv", scale
        else:
            yield key, t.to(rest)


def _file_mode() -> int:
    """The mode a plain new file gets under this process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_checkpoint(config: dict, out: str | Path, *, seed: int = 0, dtype: str = "float32",
                     layout: Layout = "per-expert") -> Path:
    """Writes config.json and safetensors shards. dtype "fp8": the block-FP8 layout (per-expert
    keys, as FP8 releases have), unquantized tensors in bf16."""
    cfg = ModelConfig.from_dict(config)
    if dtype == "fp8":
        if layout != "per-expert":
            raise ValueError("an FP8 checkpoint is written with per-expert keys (the layout of FP8 releases)")
        full = {**config, "quantization_config": dict(FP8_CONFIG)}
        return _save(quantized_tensors(random_tensors(cfg, seed, torch.float32)), full, Path(out), "bfloat16")
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    return _save(random_tensors(cfg, seed, tdtype, layout), config, Path(out), dtype)


def write_dequantized(src: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """The twin of an FP8 checkpoint: the same keys minus the scales, every FP8 weight replaced by
    its dequantized value (formed in fp32, as the engine's FP8 path forms it, then cast to `dtype`),
    and config.json without quantization_config: an ordinary checkpoint any loader reads."""
    from .loader import _files, _Reader
    src = Path(src)
    config = json.loads((src / "config.json").read_text())
    block = ModelConfig.from_dict(config).fp8_block
    if block is None:
        raise ValueError(f"{src}/config.json declares no FP8 quantization_config: nothing to dequantize")
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    reader = _Reader(_files(src))

    def tensors():
        for key in reader.files:
            if key.endswith("_scale_inv"):
                continue
            t = reader.get(key)
            if t.dtype == fp8.FP8:
                yield key, fp8.dequantize(t, reader.get(key + "_scale_inv"), block, tdtype)
            else:
                yield key, t.to(tdtype)
    config.pop("quantization_config")
    return _save(tensors(), config, Path(out), dtype)


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
                 backends=None, mtp: bool = False, head_only: bool = False):
    """Builds the model directly on `device` with random weights of the same scales as
    `random_tensors` (other values): a 30B-parameter benchmark model needs no checkpoint on disk.
    `head_only` (Qwen3MoeModel's): its tensors equal the unsharded model's of the same seed."""
    from .backends import REFERENCE
    from .qwen3_moe import Qwen3MoeModel, Shard
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = Qwen3MoeModel(cfg, shard or Shard(), collectives, backends or REFERENCE, mtp=mtp,
                                  head_only=head_only)
        with torch.device("meta"):   # full shapes: which tensors this shard splits
            full = {n: p.shape for n, p in Qwen3MoeModel(cfg, Shard(), None, mtp=mtp,
                                                         head_only=head_only).named_parameters()}
    finally:
        torch.set_default_dtype(prev)
    shard = shard or Shard()
    model = model.materialize(device)
    gen = torch.Generator(device=device)
    for name, p in model.named_parameters():
        # Seeded per name, so a replicated tensor is the same on every rank of a sharded model;
        # a split tensor also by the shard's coordinates, so two ranks' slices differ.
        key = name if p.shape == full[name] else \
            f"{name}@{shard.atp_rank}/{shard.atp_size}:{shard.ep_rank}/{shard.ep_size}"
        gen.manual_seed(seed ^ zlib.crc32(key.encode()))
        if name.endswith("norm.weight"):
            p.normal_(1.0, 0.1, generator=gen)
        elif name.endswith("scale_inv"):   # FP8: unit normal e4m3 values times the fan-in std
            owner = name.removesuffix("_scale_inv").removesuffix(".weight")
            weight = owner + ".weight" if owner + ".weight" in full else owner
            p.fill_(_init_std(weight, full[weight]))
        elif p.dtype == fp8.FP8:
            p.copy_(torch.empty(p.shape, device=device).normal_(0.0, 1.0, generator=gen))
        else:
            p.normal_(0.0, _init_std(name, p.shape), generator=gen)
    model.tie_weights_if_needed()
    model.fuse_projections()
    return model
