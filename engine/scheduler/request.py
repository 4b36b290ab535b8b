"""Requests: sampling parameters (SGLang's `sampling_params` keys), per-request state, and the
incremental output the engine returns each step."""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from .kv_pool import Reservation


class RequestError(ValueError):
    """Bad input for one request; the engine keeps serving the others."""


# SGLang keys we accept only at their neutral value (clients often send the defaults).
_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
            "min_p": 0.0, "n": 1, "stop": None, "regex": None, "json_schema": None, "ebnf": None,
            "logit_bias": None, "stream_interval": None}
# Text-only SGLang keys: no tokenizer here, so they do not change token output.
_TEXT_ONLY = {"skip_special_tokens": bool, "spaces_between_special_tokens": bool, "no_stop_trim": bool}


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @classmethod
    def from_dict(cls, d: dict | None) -> "SamplingParams":
        d = dict(d or {})
        if "sampling_seed" in d:           # SGLang's name for the per-request seed
            d["seed"] = d.pop("sampling_seed")
        kw = {}

        def num(key, kind, lo=None, hi=None, lo_open=False):
            v = d.pop(key)
            ok_types = (int,) if kind is int else (int, float)
            if isinstance(v, bool) or not isinstance(v, ok_types):
                raise RequestError(f"sampling_params.{key} must be {'an integer' if kind is int else 'a number'}, got {v!r}")
            if not math.isfinite(v):   # JSON NaN/Infinity: a NaN temperature made every sample fail
                raise RequestError(f"sampling_params.{key} must be a finite number, got {v!r}")
            if lo is not None and (v <= lo if lo_open else v < lo):
                raise RequestError(f"sampling_params.{key} must be {'>' if lo_open else '>='} {lo}, got {v!r}")
            if hi is not None and v > hi:
                raise RequestError(f"sampling_params.{key} must be <= {hi}, got {v!r}")
            kw[key] = kind(v)

        for key, kind, lo, hi, lo_open in (("max_new_tokens", int, 0, None, True), ("min_new_tokens", int, 0, None, False),
                                           ("temperature", float, 0, None, False), ("top_p", float, 0, 1, True),
                                           ("top_k", int, None, None, False)):
            if key in d and d[key] is not None:
                num(key, kind, lo, hi, lo_open)
            else:
                d.pop(key, None)
        if "top_k" in kw and kw["top_k"] == 0 or kw.get("top_k", -1) < -1:
            raise RequestError(f"sampling_params.top_k must be -1 (off) or >= 1, got {kw['top_k']}")
        if "seed" in d:
            v = d.pop("seed")
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise RequestError(f"sampling_params.seed must be an integer, got {v!r}")
            if v is not None and not -(1 << 63) <= v < (1 << 64):   # torch.Generator's seed range
                raise RequestError(f"sampling_params.seed must be in [-2**63, 2**64), got {v!r}")
            kw["seed"] = v
        if "ignore_eos" in d:
            v = d.pop("ignore_eos")
            if not isinstance(v, bool):
                raise RequestError(f"sampling_params.ignore_eos must be a boolean, got {v!r}")
            kw["ignore_eos"] = v
        if "stop_token_ids" in d:
            v = d.pop("stop_token_ids")
            if v is None:
                v = []
            if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
                raise RequestError(f"sampling_params.stop_token_ids must be a list of integers, got {v!r}")
            kw["stop_token_ids"] = tuple(v)
        for key, typ in _TEXT_ONLY.items():
            if key in d:
                v = d.pop(key)
                if not isinstance(v, typ):
                    raise RequestError(f"sampling_params.{key} must be a boolean, got {v!r}")
                kw[key] = v
        # SGLang hands custom_params to a server-side custom logit processor; with none
        # configured it has no effect there either (slime sends it whenever top_p != 1).
        if "custom_params" in d:
            v = d.pop("custom_params")
            if v is not None and not isinstance(v, dict):
                raise RequestError(f"sampling_params.custom_params must be an object, got {v!r}")
            if v and v.get("return_top_p_token_ids"):   # slime's top_p != 1 rollouts read meta_info.top_p_token_ids
                raise RequestError("sampling_params.custom_params.return_top_p_token_ids is not supported: this "
                                   "engine does not report the top-p kept token ids (roll out with top_p 1.0)")
        for key, neutral in _NEUTRAL.items():
            if key in d:
                v = d.pop(key)
                if v != neutral and not (v == [] and neutral is None):
                    raise RequestError(f"sampling_params.{key}={v!r} is not supported "
                                       f"(only {neutral!r}; this engine works on token ids)")
        if d:
            raise RequestError(f"unknown sampling_params key(s): {', '.join(sorted(d))}")
        if kw.get("min_new_tokens", 0) > kw.get("max_new_tokens", cls.max_new_tokens):
            raise RequestError("sampling_params.min_new_tokens must not exceed max_new_tokens")
        return cls(**kw)


class Status(enum.Enum):
    WAITING = "waiting"        # no KV yet (or retracted)
    PREFILL = "prefill"        # admitted, prompt partly computed
    DECODE = "decode"          # promoted: one token per step
    FINISHED = "finished"


@dataclass
class Req:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    rollout_id: str | None = None
    priority: int = 0                  # higher first (SGLang's default order); RL: the trajectory's work left
    arrival: float = field(default_factory=time.monotonic)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    status: Status = Status.WAITING
    computed: int = 0                  # tokens whose KV is in the cache
    cached_tokens: int = 0             # of the prompt, found in the prefix cache
    reservation: Reservation | None = None
    d_ready_at: float | None = None    # when this row became ready for its next decode step
    first_token_at: float | None = None
    emitted: int = 0                   # output tokens already reported
    routes_from: int | None = None     # report routing of positions [routes_from, len(tokens) - 1)
    route_parts: list[bytes] = field(default_factory=list)   # per computed position, in order
    retractions: int = 0
    spec_verify_ct: int = 0            # D iterations under speculation (each emits >= 1 token)
    spec_proposed: int = 0             # draft tokens proposed
    spec_accepted: int = 0             # draft tokens the target accepted
    _tokens: list[int] = field(default_factory=list, init=False, repr=False, compare=False)
    _tokens_of: list[int] | None = field(default=None, init=False, repr=False, compare=False)   # the output list followed

    @property
    def tokens(self) -> list[int]:
        """prompt + output as one list, extended as the output list grows, not rebuilt: the planner
        reads it several times per row per step, and concatenating a long context each time was a
        measurable share of a large batch's step on the host. Read it; never mutate it."""
        t, n = self._tokens, len(self.prompt)
        if self._tokens_of is not self.output or len(t) > n + len(self.output):   # a new output list
            t[:] = self.prompt
            self._tokens_of = self.output
        if len(t) < n + len(self.output):
            t.extend(self.output[len(t) - n:])
        return t

    @property
    def prefill_remaining(self) -> int:
        return len(self.prompt) - self.computed

    @property
    def lifetime(self) -> int:
        return self.reservation.lifetime if self.reservation else 0


@dataclass
class RequestOutput:
    rid: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None
    finished: bool
    finish_reason: dict | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    rollout_id: str | None = None
    weight_version: str = "default"    # the weights that produced new_token_ids
    routed_experts: bytes | None = None   # on the finished output of a routed request: int32 [pos, layers, k]
    spec: tuple[int, int, int] | None = None   # speculation on: (D iterations, drafts proposed, accepted) so far

    def spec_meta(self) -> dict:
        """SGLang's speculative meta_info keys; accept length = tokens per D iteration (bonus included)."""
        if self.spec is None:
            return {}
        verify, proposed, accepted = self.spec
        # both SGLang namings: slime and AReaL read spec_accept_token_num / spec_draft_token_num
        return {"spec_verify_ct": verify, "spec_accepted_drafts": accepted, "spec_proposed_drafts": proposed,
                "spec_accept_token_num": accepted, "spec_draft_token_num": proposed,
                "spec_accept_rate": accepted / proposed if proposed else 0.0,
                "spec_accept_length": (verify + accepted) / verify if verify else 0.0}
