"""Weights of a running model, by checkpoint key: which part of a full tensor this rank's shard
holds and where it goes. One map serves a load from disk (read only the shard's slice), a tensor
broadcast by a trainer (full tensor in, the shard's slice kept) and a check of names and shapes
before anything changes. Writes are in place: tensor addresses stay (CUDA graphs stay valid)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..protocol.config import ModelConfig
from .loader import CheckpointError, _Reader, _files, _head_rows
from .qwen3_moe import Qwen3MoeModel, Shard

_PER_EXPERT = re.compile(r"^((model|mtp)\.layers\.(\d+)\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"^(model|mtp)\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16, "float64": torch.float64}


def parse_dtype(name: str) -> torch.dtype:
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise CheckpointError(f"dtype {name!r} is not supported (one of {', '.join(DTYPES)})")
    return DTYPES[key]


@dataclass(frozen=True)
class Placement:
    param: str
    dst: tuple            # index into the parameter
    rows: slice | None    # of the full tensor (dim 0)
    cols: slice | None    # of the full tensor (dim 1)


class WeightMap:
    def __init__(self, model: Qwen3MoeModel, cfg: ModelConfig, shard: Shard) -> None:
        self.model, self.cfg, self.shard = model, cfg, shard
        with torch.device("meta"):
            full = Qwen3MoeModel(cfg, Shard(), mtp=model.mtp is not None)
            self.full = {n: tuple(p.shape) for n, p in full.named_parameters()}
        if cfg.tie_word_embeddings:
            self.full.pop("lm_head.weight", None)

    def _refuse_fp8(self) -> None:
        # A trainer's bf16 tensors would need quantizing into the e4m3 weights and their scales;
        # copying them in would silently corrupt the model.
        if self.cfg.fp8_block is not None:
            raise CheckpointError("weight updates of an FP8 model (quantization_config) are not supported yet: "
                                  "restart the engine on the new checkpoint")

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    # ---- names and shapes ---------------------------------------------------------------
    def full_shape(self, name: str) -> tuple:
        """The shape a full tensor of this checkpoint key must have; CheckpointError for a key
        that is not part of this model."""
        c = self.cfg
        m = _PER_EXPERT.match(name)
        if m:
            layer, e, which = int(m.group(3)), int(m.group(4)), m.group(5)
            count = c.num_hidden_layers
            if m.group(2) == "mtp":   # the MTP head's layers come after the target's
                layer, count = layer + count, count + c.num_nextn_predict_layers
            if not (layer < count and c.is_moe_layer(layer) and e < c.num_experts):
                raise CheckpointError(f"unexpected tensor {name!r} (no such expert in this model)")
            i, h = c.moe_intermediate_size, c.hidden_size
            return (h, i) if which == "down" else (i, h)
        if name not in self.full:
            raise CheckpointError(f"unexpected tensor {name!r} (not part of a Qwen3-MoE model with this config)")
        return self.full[name]

    def skipped(self, name: str) -> bool:
        """An MTP tensor of a model that runs without its MTP head (not --speculative mtp)."""
        return name.startswith("mtp.") and self.model.mtp is None and self.cfg.num_nextn_predict_layers > 0

    def check(self, shapes: dict[str, tuple]) -> None:
        """Every name known and every shape the full one."""
        self._refuse_fp8()
        for name, shape in shapes.items():
            if self.skipped(name):
                continue
            want = self.full_shape(name)
            if tuple(shape) != want:
                raise CheckpointError(f"tensor {name!r} has shape {tuple(shape)}, model expects {want}")

    def check_complete(self, names) -> None:
        """A whole checkpoint: every parameter, experts fused or every per-expert key."""
        names = set(names)
        for p in self.full:
            if p in names:
                continue
            m = _FUSED.match(p)
            if m:
                which = ("gate", "up") if m.group(3) == "gate_up_proj" else ("down",)
                pre = f"{m.group(1)}.layers.{m.group(2)}.mlp.experts"
                missing = [f"{pre}.{e}.{w}_proj.weight" for e in range(self.cfg.num_experts) for w in which
                           if f"{pre}.{e}.{w}_proj.weight" not in names]
                if not missing:
                    continue
                raise CheckpointError(f"checkpoint is missing {missing[0]!r} (or the fused {p!r})")
            raise CheckpointError(f"checkpoint is missing tensor {p!r}")

    # ---- where a key goes on this shard ---------------------------------------------------
    def place(self, name: str, params: dict) -> Placement | None:
        """None when this shard holds no part of the key."""
        c, s = self.cfg, self.shard
        if self.skipped(name):
            return None
        m = _PER_EXPERT.match(name)
        if m:
            pre, e, which = m.group(1), int(m.group(4)), m.group(5)
            target = f"{pre}.{'down_proj' if which == 'down' else 'gate_up_proj'}"
            if target not in params:
                return None   # a layer a head-only model does not hold (runtime/mtp.py)
            local = e - s.ep_rank * params[target].shape[0]
            if not 0 <= local < params[target].shape[0]:
                return None
            i = c.moe_intermediate_size
            dst = {"gate": (local, slice(0, i)), "up": (local, slice(i, 2 * i)), "down": (local,)}[which]
            return Placement(target, dst, None, None)
        if name not in params:
            return None   # a tied lm_head
        n = params[name].shape[0]
        if _FUSED.match(name):
            lo = s.ep_rank * n
            return Placement(name, (), slice(lo, lo + n), None)
        tail = name.split("self_attn.")[-1]
        heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads, "v_proj": c.num_key_value_heads}
        kind = tail.split(".")[0]
        if "self_attn." in name and kind in heads and s.atp_size > 1:
            return Placement(name, (), _head_rows(heads[kind], c.head_dim, s), None)
        if name.endswith("self_attn.o_proj.weight") and s.atp_size > 1:
            return Placement(name, (), None, _head_rows(c.num_attention_heads, c.head_dim, s))
        return Placement(name, (), None, None)

    # ---- writes -----------------------------------------------------------------------------
    @torch.no_grad()
    def write(self, name: str, full: torch.Tensor, params: dict | None = None) -> bool:
        """This shard's part of a full tensor, copied in place. True when something was written."""
        self._refuse_fp8()
        params = params or self.params()
        pl = self.place(name, params)
        if pl is None:
            return False
        src = full
        if pl.rows is not None:
            src = src[pl.rows]
        if pl.cols is not None:
            src = src[:, pl.cols]
        params[pl.param][pl.dst].copy_(src)
        return True

    @torch.no_grad()
    def load_dir(self, model_dir: str | Path) -> int:
        """Every key of a checkpoint directory, reading only this shard's slices; returns how many
        tensors were written on this rank."""
        self._refuse_fp8()
        reader = _Reader(_files(Path(model_dir)))
        params = self.params()
        n = 0
        for key in reader.files:
            pl = self.place(key, params)
            if pl is None:
                continue
            params[pl.param][pl.dst].copy_(reader.get(key, pl.rows, pl.cols))
            n += 1
        return n


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple]:
    """Key -> shape of every tensor of a checkpoint directory (metadata only)."""
    from safetensors import safe_open
    out = {}
    by_file: dict[Path, list[str]] = {}
    for key, f in _files(Path(model_dir)).items():
        by_file.setdefault(f, []).append(key)
    for f, keys in by_file.items():
        with safe_open(str(f), "pt") as h:
            for k in keys:
                out[k] = tuple(h.get_slice(k).get_shape())
    return out
