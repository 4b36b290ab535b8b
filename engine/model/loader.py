"""Loads Hugging Face safetensors into `Qwen3MoeModel`, in either expert layout:
per-expert keys (`mlp.experts.{i}.{gate,up,down}_proj.weight`, as on the Hub) or fused
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]).
Only this rank's shard of attention heads and experts is materialized.

A config with an FP8 `quantization_config` (see fp8.py) loads e4m3 weights and their
`weight_scale_inv` block scales as they are (no dequantization at load): the quantized linears
are attention q/k/v/o, dense MLP and expert gate/up/down; embeddings, norms, the router and
lm_head are plain tensors of the load dtype."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..protocol.config import ModelConfig
from . import fp8
from .backends import REFERENCE, Backends
from .qwen3_moe import Qwen3MoeModel, Shard

_PER_EXPERT = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale_inv)$")


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the offending key."""


def _files(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        wm = json.loads(index.read_text())["weight_map"]
        return {k: model_dir / f for k, f in wm.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            out.update({k: f for k in h.keys()})
    return out


class _Reader:
    def __init__(self, files: dict[str, Path]):
        self.files = files
        self._handles = {}

    def get(self, key: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        f = self.files[key]
        h = self._handles.get(f) or self._handles.setdefault(f, safe_open(str(f), "pt"))
        t = h.get_slice(key)
        if rows is None and cols is None:
            return t[:]
        return t[rows or slice(None), cols or slice(None)] if cols is not None else t[rows]


def _head_rows(n_heads: int, head_dim: int, shard: Shard) -> slice:
    per = n_heads // shard.atp_size
    return slice(shard.atp_rank * per * head_dim, (shard.atp_rank + 1) * per * head_dim)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    """The weights' dtype: the engine config's, or for "auto" the checkpoint's (`torch_dtype`),
    else float32."""
    if name != "auto":
        return DTYPES[name]
    return DTYPES.get(cfg.raw.get("torch_dtype") or cfg.raw.get("dtype"), torch.float32)


def _scale_part(name: str, part: slice, full: int, block: int) -> slice:
    """The block scales covering rows (or columns) `part` of a weight of `full` rows: a shard's
    slice must start on a block, else its first block's scale would be shared with another rank."""
    if part.start % block or (part.stop % block and part.stop != full):
        raise CheckpointError(f"FP8 tensor {name!r}: this shard's slice [{part.start}, {part.stop}) is not aligned "
                              f"to the {block}-wide scale blocks (fewer attention-TP ranks, or a head_dim "
                              f"whose head slices fill whole blocks)")
    return slice(part.start // block, -(-part.stop // block))


def load_model(model_dir: str | Path, *, device="cpu", dtype: torch.dtype | None = None,
               shard: Shard = Shard(), collectives=None, backends: Backends = REFERENCE,
               mtp: bool = False, head_only: bool = False) -> Qwen3MoeModel:
    """`mtp`: also load the MTP head (`mtp.*`, when config.json declares num_nextn_predict_layers);
    otherwise those tensors are left on disk. `mtp.*` tensors without the field are an error: the
    config is what says how many layers they hold. `head_only`: the head, the embedding, the final
    norm and lm_head only (the target's `model.layers.*` stay on disk)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.load(model_dir)
    files = _files(model_dir)
    reader = _Reader(files)
    with torch.device("meta"):
        model = Qwen3MoeModel(cfg, shard, collectives, backends, mtp=mtp, head_only=head_only)
    if dtype is None:
        dtype = resolve_dtype("auto", cfg)

    # Group per-expert keys by their fused destination.
    per_expert: dict[str, dict[int, dict[tuple[str, str], str]]] = {}
    direct = set()
    for key in files:
        m = _PER_EXPERT.match(key)
        if m:
            per_expert.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[(m.group(3), m.group(4))] = key
        else:
            direct.add(key)

    d = cfg.head_dim
    block = cfg.fp8_block
    sliced_rows = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads,
                   "v_proj": cfg.num_key_value_heads}
    params = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings and name not in files:
            continue
        tail = name.split("self_attn.")[-1]
        proj, _, kind = tail.partition(".")          # e.g. ("q_proj", "weight_scale_inv")
        if ".mlp.experts." in name:
            prefix, which = name.rsplit(".", 1)
            suffix = "weight_scale_inv" if which.endswith("_scale_inv") else "weight"
            which = which.removesuffix("_scale_inv")
            lo = shard.ep_rank * p.shape[0]
            experts = range(lo, lo + p.shape[0])
            if name in direct:
                t = reader.get(name, rows=slice(lo, lo + p.shape[0]))
            elif prefix in per_expert:
                got = per_expert[prefix]
                parts = ("gate", "up") if which == "gate_up_proj" else ("down",)
                for e in experts:
                    for w in parts:
                        if (w, suffix) not in got.get(e, {}):
                            raise CheckpointError(f"checkpoint is missing {prefix}.{e}.{w}_proj.{suffix}")
                t = torch.stack([torch.cat([reader.get(got[e][(w, suffix)]) for w in parts]) for e in experts])
            else:
                raise CheckpointError(f"checkpoint is missing tensor {name!r} (or its per-expert keys)")
        elif name not in files:
            hint = f" (config.json declares num_nextn_predict_layers={cfg.num_nextn_predict_layers})" \
                if name.startswith("mtp.") else ""
            raise CheckpointError(f"checkpoint is missing tensor {name!r}{hint}")
        elif "self_attn." in name and proj in sliced_rows:
            rows = _head_rows(sliced_rows[proj], d, shard)
            if kind == "weight_scale_inv":
                full = sliced_rows[proj] * d
                rows = _scale_part(name, rows, full, block[0])
            t = reader.get(name, rows=rows)
        elif "self_attn." in name and proj == "o_proj":
            cols = _head_rows(cfg.num_attention_heads, d, shard)
            if kind == "weight_scale_inv":
                cols = _scale_part(name, cols, cfg.num_attention_heads * d, block[1])
            t = reader.get(name, cols=cols)
        else:
            t = reader.get(name)
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, model expects {tuple(p.shape)}")
        if p.dtype == fp8.FP8:   # kept as stored: the FP8 bytes are the point
            if t.dtype != fp8.FP8:
                raise CheckpointError(f"tensor {name!r} is {t.dtype}, but the config's quantization_config "
                                      f"declares it float8_e4m3fn (with a {name}_scale_inv)")
            loaded[name] = t.to(device=device)
        elif name.endswith("scale_inv"):
            loaded[name] = t.to(device=device, dtype=torch.float32)
        else:
            loaded[name] = t.to(device=device, dtype=dtype)

    known = set(params) | {got for pre in per_expert for e in per_expert[pre] for got in per_expert[pre][e].values()}
    for key in files:
        if key.startswith("mtp."):
            if not cfg.num_nextn_predict_layers:
                raise CheckpointError(f"tensor {key!r} is part of an MTP head, but config.json declares no "
                                      f"num_nextn_predict_layers (set it to the number of mtp.layers.*)")
            if model.mtp is None:
                continue   # the MTP head is loaded only for --speculative mtp
        if head_only and key.startswith("model.layers."):
            continue
        if key not in known:
            hint = " (an FP8 scale, but config.json declares no quantization_config)" \
                if key.endswith("weight_scale_inv") and block is None else ""
            raise CheckpointError(f"unexpected tensor {key!r} in checkpoint (not part of a Qwen3-MoE "
                                  f"model with this config){hint}")
    model = model.materialize(device)
    model.load_state_dict(loaded, strict=False, assign=True)
    model.tie_weights_if_needed()
    for p in model.parameters():
        p.requires_grad_(False)
    model.fuse_projections()
    return model
