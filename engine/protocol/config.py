"""Configuration: the model's architecture (read from a Hugging Face config.json), the engine's
static settings, and the live control settings that `/control` changes at a step boundary."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from . import turnstile
from .removed import refuse_removed, refuse_removed_env

PRESETS_DIR = Path(__file__).parent.parent / "presets"   # engine/presets (package data)


class ConfigError(ValueError):
    """A model or engine configuration that cannot be run."""


@dataclass(frozen=True)
class ModelConfig:
    """Qwen3-MoE architecture, with transformers' `Qwen3MoeConfig` field names."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    # Block-wise FP8 weights (HF `quantization_config`, quant_method "fp8"): the [out, in] block of
    # one scale; None for an unquantized checkpoint.
    fp8_block: tuple[int, int] | None = None
    # Multi-token-prediction layers (Qwen3-Next's `mtp.*` tensors): the --speculative mtp proposer
    num_nextn_predict_layers: int = 0
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def is_moe_layer(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        arch = d.get("model_type", "qwen3_moe")
        if arch != "qwen3_moe":
            raise ConfigError(f"model_type {arch!r} is not supported (only 'qwen3_moe')")
        if d.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=true is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_type {rope_type!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", d.get("rope_theta", 1_000_000.0))
        fp8_block = parse_quantization(d.get("quantization_config"))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        try:
            heads = d["num_attention_heads"]
            return cls(
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=d.get("num_key_value_heads", heads),
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                moe_intermediate_size=d["moe_intermediate_size"],
                num_experts=d["num_experts"],
                num_experts_per_tok=d["num_experts_per_tok"],
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                decoder_sparse_step=d.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=float(theta),
                max_position_embeddings=d.get("max_position_embeddings", 32768),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", False)),
                eos_token_ids=eos_ids,
                fp8_block=fp8_block,
                num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or 0),
                raw=dict(d),
            )
        except KeyError as e:
            raise ConfigError(f"config is missing required field {e.args[0]!r}") from None

    @classmethod
    def load(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path} not found: a model directory needs config.json + *.safetensors")
        return cls.from_dict(json.loads(path.read_text()))


FP8_BLOCK = (128, 128)   # the block of Qwen3 and DeepSeek FP8 releases; the only one the loader runs


def parse_quantization(q: dict | None) -> tuple[int, int] | None:
    """The FP8 block of a config's `quantization_config` (None: not quantized). Anything but the
    block-wise, dynamic-activation e4m3 layout of Qwen3/DeepSeek FP8 releases is refused, naming
    the field, rather than loaded wrongly."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"quantization_config.quant_method {method!r} is not supported (only 'fp8')")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"quantization_config.fmt {fmt!r} is not supported (only 'e4m3')")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(f"quantization_config.activation_scheme {scheme!r} is not supported "
                          f"(only 'dynamic': static activation scales are not read)")
    block = q.get("weight_block_size")
    if block is None or list(block) != list(FP8_BLOCK):
        raise ConfigError(f"quantization_config.weight_block_size {block!r} is not supported "
                          f"(only {list(FP8_BLOCK)}: per-tensor and other block sizes are not implemented)")
    return FP8_BLOCK


def load_preset(name_or_path: str) -> dict:
    """A config dict from a preset name (engine/presets/NAME.json) or a JSON file path."""
    p = Path(name_or_path)
    if not p.is_file():
        p = PRESETS_DIR / f"{name_or_path}.json"
    if not p.is_file():
        names = sorted(x.stem for x in PRESETS_DIR.glob("*.json"))
        raise ConfigError(f"no config file or preset named {name_or_path!r} (presets: {', '.join(names)})")
    return json.loads(p.read_text())


KV_SPLITS_MAX = 16   # decode attention's context splits (model/kernels.py)
SPEC_K_MAX = 8        # verify rows carry k + 1 tokens; D's expert buffers are sized for this many
SOLO_FUSE_TOKENS_CUDA = 512   # EngineConfig.solo_fuse_tokens' default on CUDA (docs/PERF.md)
DEFAULT_KV_CACHE_BYTES = 256 << 20   # kv_cache_bytes where nothing measures free memory (CPU, several ranks)
# The rest of the measured free memory is the margin for what the start-up probe does not run:
# sampling, NCCL buffers, cuDNN plans, allocator fragmentation (docs/ENGINE_API.md)
KV_MEM_FRACTION = 0.9

# the values of turnstile's enums, defined there once
Activation = Literal[tuple(a.value for a in turnstile.Activation)]
Ordering = Literal[tuple(o.value for o in turnstile.Ordering)]
Mode = Literal["normal", "mixed", "pd"]


class ControlSettings(BaseModel):
    """Live controls; validated as a whole so an invalid PUT changes nothing."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    activation: Activation = "auto"
    span: int | Literal["auto"] = "auto"
    prefill_budget_tokens: int = Field(default=32768, gt=0)
    ordering: Ordering = "fine-grained"
    # pd: once the oldest request without its first token has waited this long, P runs whole-budget
    # segments until it has its token (None: segments stay span-sized)
    p_wait_bound_ms: float | None = Field(default=None, gt=0)
    # pd: P below the top priority waits up to this long to share one P-carrying step (None: never)
    p_gather_ms: float | None = Field(default=None, gt=0)
    # pd: when more requests wait for their first token than rows decode (a burst: a rollout's first
    # turns, many trajectories back at once), P runs alone as under `normal` — the backlog is where
    # trajectories stand still. None: the engine's default (on for P epochs beside D, runtime/engine.py)
    p_burst_first: bool | None = None

    @field_validator("span", mode="before")
    @classmethod
    def _span(cls, v):
        if isinstance(v, bool) or (not isinstance(v, int) and v != "auto"):
            raise ValueError("span must be an integer 1..4 or 'auto'")
        if isinstance(v, int) and not 1 <= v <= 4:
            raise ValueError("span must be an integer 1..4 or 'auto'")
        return v

    def updated(self, changes: dict) -> "ControlSettings":
        return ControlSettings.model_validate({**self.model_dump(), **changes})


class KernelPicks(BaseModel):
    """The kernels a CUDA forward runs (model/backends.make_backends); CPU always runs the reference."""

    # routed experts on CUDA: grouped GEMMs, the fused Triton path (model/fused_moe.py), or auto: fused
    # at every size, with 16-, 64- or 128-row tiles by the rows an expert sees (backends.fused_tiles)
    experts_kernel: Literal["auto", "grouped", "fused"] = "auto"
    # q/k norm + RoPE + KV write: torch ops, one Triton launch a layer (model/prologue.py), or auto:
    # fused in bf16 on CUDA, the torch ops elsewhere (fp32 stays on the exact reference ops)
    qk_prologue: Literal["auto", "torch", "fused"] = "auto"
    # residual add + RMSNorm in one Triton pass (model/norms.py), or auto: fused in bf16 on CUDA (a
    # faster decode step, docs/PERF.md), the torch ops elsewhere
    add_norm: Literal["auto", "torch", "fused"] = "auto"
    # decode attention on CUDA split along the context (flash-decoding, model/kernels.py): n programs
    # per (row, KV head), or "auto" from the batch and the SM count (splits only while the batch's
    # programs fill less than a wave); 1: always one pass
    decode_kv_splits: Annotated[int, Field(ge=1, le=KV_SPLITS_MAX)] | Literal["auto"] = "auto"
    # MoE routing (softmax, top-k, renormalize) in one Triton pass per token (model/router.py), or
    # auto: fused in bf16 on CUDA (a faster decode step, docs/PERF.md), the torch ops elsewhere
    router: Literal["auto", "torch", "fused"] = "auto"
    # prefill attention on CUDA: SDPA per segment over its gathered context (sdpa), or every segment
    # of a step in one Triton launch straight from the paged cache (triton, bf16; model/paged_prefill.py).
    # SDPA costs several launches and a Python dispatch per segment and layer, which bound P epochs of
    # many continuation turns (docs/PERF.md). hybrid: a step of at most 8,192 tokens whose segments
    # are all fresh prompts of >= 2,048 runs SDPA on cuDNN (faster than the launch on long fresh
    # prompts, docs/PERF.md), lengths rounded up to 512 and batched per length so cuDNN builds a
    # bounded set of plans, all at start; any other step runs the launch.
    # auto: hybrid in bf16 on SM90+ with cuDNN, triton in bf16 before SM90, sdpa in other dtypes
    prefill_attention: Literal["auto", "sdpa", "triton", "hybrid"] = "auto"
    # the paged launch's walks split along the context into n stretches, merged by a second launch;
    # auto: when a step's tiles leave SMs idle (one continuation fused into D's step), up to one
    # program per SM (model/paged_prefill.walk_splits); 1: every walk whole
    prefill_kv_splits: Annotated[int, Field(ge=1, le=KV_SPLITS_MAX)] | Literal["auto"] = "auto"


class PDTuning(BaseModel):
    """How P and D share one device: P's graphs, P epochs beside D, stream priority, gathering."""

    # Forwards that carry P of up to this many tokens replay piecewise CUDA graphs, one set per token
    # bucket, cut at each layer's attention (runtime/prefill_graphs.py): an eager P epoch is bound by
    # issuing its kernels (docs/PERF.md). None: 4096 on CUDA with one rank, off elsewhere; 0 or
    # `cuda_graphs: false`: off. On CPU a number runs the same pieces eagerly (the padding and
    # buffers, for tests). Several ranks: at ATP1 on the torch expert backend (prefill_graphs.py).
    prefill_graph_tokens: int | None = Field(default=None, ge=0)
    # pd on one rank: a P epoch runs on a thread (CUDA: a stream) of its own while the next steps' D
    # goes on, as on several ranks, instead of one fused P+D forward (runtime/solo_p.py). None: on CUDA
    # (measured: docs/PERF.md), off on CPU, where P and D would only take turns on the same cores
    solo_overlap: bool | None = None
    # pd on one rank with solo_overlap: a step whose P is at most this many tokens runs as one fused
    # P+D forward instead of an epoch beside D. A P of a few hundred tokens reads nearly every
    # expert's weights, as a D step does: fused, they are read once and P's first tokens come a step
    # sooner; beside D, the epoch slows D's steps for two steps or more. None: 512 on CUDA (lower
    # TTFT at P1 than every P beside D, makespan level or lower: docs/PERF.md), 0 elsewhere; 0: every
    # P beside D. Not on several ranks (their P spans D through the turnstile).
    solo_fuse_tokens: int | None = Field(default=None, ge=0)
    # pd on CUDA: the phase whose stream runs at high priority, so SMs that free up go to its kernels
    # first; "none": equal priorities. None: "d" on one rank (D first shortened pd's makespan at P1:
    # docs/PERF.md), "none" on several (not measured there).
    priority_stream: Literal["d", "none"] | None = None
    # pd: an idle engine (nothing decoding or prefilling) holds arriving requests while they keep
    # coming less than policy.IDLE_QUIET_MS apart, up to this long after the first. A rollout's first
    # turns reach the server over a few ms; otherwise the first one alone takes a step the others wait
    # out (docs/PERF.md). None: off (opt-in until measured)
    p_idle_gather_ms: float | None = Field(default=None, gt=0)
    # Run every prefill kernel regime once before serving (Triton loads and tile choices by size,
    # cuBLAS picks, allocator growth): otherwise a cold first burst pays for them in its TTFT, in
    # every mode, differently each run. None: on CUDA with one rank (runtime/engine.py)
    prefill_warmup: bool | None = None

    def solo_overlap_on(self, device_type: str) -> bool:
        return self.solo_overlap if self.solo_overlap is not None else device_type == "cuda"

    def priority_stream_on(self, multi: bool) -> str | None:
        """The phase whose stream gets the device's highest priority (None: neither)."""
        if self.priority_stream is None:
            return None if multi else "d"
        return None if self.priority_stream == "none" else self.priority_stream

    def solo_fuse_tokens_on(self, device_type: str) -> int:
        if self.solo_fuse_tokens is not None:
            return self.solo_fuse_tokens
        return SOLO_FUSE_TOKENS_CUDA if device_type == "cuda" else 0


class Speculation(BaseModel):
    """Speculative decoding inside D (docs/ARCHITECTURE.md, "Speculation"): None = off."""

    speculative: Literal["ngram", "draft", "mtp"] | None = None
    speculative_k: int = 4                                # draft tokens proposed per decode row
    draft_model: str | None = None                        # checkpoint of speculative="draft"

    @field_validator("speculative_k")
    @classmethod
    def _spec_k(cls, v):
        if not 1 <= v <= SPEC_K_MAX:
            raise ValueError(f"speculative_k must be in 1..{SPEC_K_MAX}, got {v}")
        return v


class MemorySizing(BaseModel):
    """The KV cache's blocks and budget (docs/ENGINE_API.md, "The engine sized for its GPU")."""

    block_size: int = Field(default=16, gt=0)
    num_blocks: int | None = Field(default=None, gt=0)  # None: sized from kv_cache_bytes
    # None: on one CUDA rank, kv_mem_fraction of the memory free once the weights, the graphs and the
    # largest step hold theirs (runtime/kv_sizing.py); elsewhere DEFAULT_KV_CACHE_BYTES
    kv_cache_bytes: int | None = Field(default=None, gt=0)
    kv_mem_fraction: float = Field(default=KV_MEM_FRACTION, gt=0, le=1)


class EngineConfig(KernelPicks, PDTuning, Speculation, MemorySizing):
    """Static engine settings (fixed for the life of an engine): its groups' fields and these, one
    flat set of keys as --engine-config takes them."""

    model_config = ConfigDict(extra="forbid")

    model: str
    device: str = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    mode: Mode = "pd"
    max_running: int = Field(default=64, gt=0)          # decode batch limit, same for every mode
    max_context_len: int | None = None                   # None: the model's max_position_embeddings
    mixed_chunk_tokens: int = Field(default=8192, gt=0)  # chunk size of the `mixed` baseline
    seed: int = 0
    cuda_graphs: bool = True                              # decode graphs per batch bucket (CUDA only)
    random_weights: bool = False                          # init on the device; `model` needs only config.json
    control: ControlSettings = ControlSettings()

    def prefill_graph_tokens_on(self, device_type: str, eager_p: bool) -> int:
        """The token bound of P's piecewise graphs on this worker (0: P runs eagerly). `eager_p`:
        several ranks whose P cannot be cut into pieces (ATP > 1 or DeepEP)."""
        if eager_p:
            return 0
        if self.prefill_graph_tokens is not None:
            return self.prefill_graph_tokens if device_type == "cpu" or self.cuda_graphs else 0
        return 4096 if device_type == "cuda" and self.cuda_graphs else 0

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data):
        refuse_removed_env()
        return refuse_removed(data)

    @model_validator(mode="after")
    def _draft(self):
        if self.speculative == "mtp" and ModelConfig.load(self.model).num_nextn_predict_layers < 1:
            raise ValueError(f"speculative='mtp' needs an MTP head: {self.model}/config.json declares no "
                             f"num_nextn_predict_layers >= 1 (and so no mtp.* tensors)")
        if self.speculative != "draft":
            if self.draft_model is not None:
                raise ValueError("draft_model is only used by speculative='draft'")
            return self
        if not self.draft_model:
            raise ValueError("speculative='draft' needs draft_model (a checkpoint with the target's vocabulary)")
        draft, target = ModelConfig.load(self.draft_model), ModelConfig.load(self.model)
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"draft_model {self.draft_model}: a vocabulary of {draft.vocab_size} tokens, the "
                             f"target's has {target.vocab_size} (a draft must share the tokenizer)")
        return self
