"""Request bodies of the HTTP API (pydantic, unknown fields rejected) and the SGLang-shaped
response builders. Pure: no engine, no aiohttp."""
from __future__ import annotations

import base64
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, model_validator

TokenIds = list[StrictInt]
PRIORITY_MAX = 2**31 - 1   # `priority` is an int32 in SGLang's and vLLM's request schemas


class BadRequest(ValueError):
    """A request the server rejects with a 4xx; `status` picks the code."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def validation_message(err: ValidationError) -> str:
    """One line per problem: `field.path: what is wrong`."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "body"
        parts.append(f"{loc}: {e['msg']}")
    return "; ".join(parts)


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise BadRequest(validation_message(e)) from None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _neutral(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported (only {allowed[0]!r})")


class GenerateRequest(_Strict):
    """SGLang `GenerateReqInput`, the fields RL clients send. Fields SGLang clients send at their
    default (image_data=None, lora_path=None, ...) are accepted at that value only."""

    input_ids: Optional[Union[TokenIds, list[TokenIds]]] = None
    text: Optional[Union[str, list[str]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    rid: Optional[Union[str, list[str]]] = None
    return_logprob: Optional[Union[StrictBool, list[StrictBool]]] = None
    logprob_start_len: Optional[Union[StrictInt, list[StrictInt]]] = None
    top_logprobs_num: Optional[Union[StrictInt, list[StrictInt]]] = None
    token_ids_logprob: Optional[Any] = None
    return_text_in_logprobs: StrictBool = False
    stream: StrictBool = False
    log_metrics: StrictBool = True
    image_data: Optional[Any] = None
    lora_path: Optional[Any] = None
    return_routed_experts: StrictBool = False
    routed_experts_start_len: StrictInt = 0
    return_hidden_states: StrictBool = False
    custom_logit_processor: Optional[Any] = None
    data_parallel_rank: Optional[StrictInt] = None
    rollout_id: Optional[str] = None
    priority: Optional[Union[StrictInt, list[StrictInt]]] = None   # admission order, higher first
    # sglang-router re-sends the body with every GenerateReqInput field it knows, at their defaults
    model: Optional[str] = None
    background: StrictBool = False
    no_logs: StrictBool = False
    return_bytes: StrictBool = False
    return_entropy: StrictBool = False

    @model_validator(mode="after")
    def _check(self):
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("exactly one of input_ids or text is required")
        if isinstance(self.input_ids, list) and len(self.input_ids) == 0:
            raise ValueError("input_ids is empty")
        for name, allowed in (("image_data", (None, [])), ("lora_path", (None,)),
                              ("token_ids_logprob", (None,)), ("custom_logit_processor", (None,)),
                              ("return_hidden_states", (False,)), ("background", (False,)),
                              ("return_bytes", (False,)), ("return_entropy", (False,))):
            _neutral(name, getattr(self, name), allowed)
        tops = self.top_logprobs_num if isinstance(self.top_logprobs_num, list) else [self.top_logprobs_num]
        if any(t not in (None, 0) for t in tops):
            raise ValueError("top_logprobs_num > 0 is not supported (only the sampled token's logprob)")
        return self

    def items(self, tokenize=None) -> list["GenerateItem"]:
        """Splits a (possibly batched) request into one item per prompt."""
        if self.input_ids is not None:
            batched = isinstance(self.input_ids[0], list)
            prompts = self.input_ids if batched else [self.input_ids]
        else:
            if tokenize is None:
                raise BadRequest("text prompts need a tokenizer: start the server with --tokenizer DIR, "
                                 "or send input_ids")
            batched = isinstance(self.text, list)
            prompts = [tokenize(t) for t in (self.text if batched else [self.text])]
        n = len(prompts)
        if batched and n == 0:
            raise BadRequest("empty batch")

        def per_item(name: str, value, default):
            if isinstance(value, list):
                if not batched or len(value) != n:
                    raise BadRequest(f"{name} is a list of {len(value)}, but the request has {n} "
                                     f"{'prompts' if batched else 'prompt (not a batch)'}")
                return value
            return [default if value is None else value] * n

        sps = per_item("sampling_params", self.sampling_params, {})
        lps = per_item("return_logprob", self.return_logprob, False)
        if isinstance(self.rid, list):
            rids = per_item("rid", self.rid, None)
        elif self.rid is not None and batched:
            raise BadRequest("rid must be a list of strings for a batch request")
        else:
            rids = [self.rid] * n
        for ids in prompts:
            if len(ids) == 0:
                raise BadRequest("a prompt has no tokens")
        routes = self.routed_experts_start_len if self.return_routed_experts else None
        prios = per_item("priority", self.priority, 0)
        for p in prios:
            if not -PRIORITY_MAX <= p <= PRIORITY_MAX:
                raise BadRequest(f"priority must be an integer in [-{PRIORITY_MAX}, {PRIORITY_MAX}], got {p}")
        return [GenerateItem(input_ids=list(p), sampling_params=sp, rid=r, return_logprob=lp, routes_from=routes,
                             priority=pr)
                for p, sp, r, lp, pr in zip(prompts, sps, rids, lps, prios)]

    @property
    def batched(self) -> bool:
        if self.input_ids is not None:
            return isinstance(self.input_ids[0], list)
        return isinstance(self.text, list)


class GenerateItem(BaseModel):
    input_ids: list[int]
    sampling_params: dict[str, Any]
    rid: Optional[str]
    return_logprob: bool
    routes_from: Optional[int] = None    # return_routed_experts: positions [routes_from, end)
    priority: int = 0


class AbortRequest(_Strict):
    rid: str = ""
    abort_all: StrictBool = False

    @model_validator(mode="after")
    def _check(self):
        if not self.rid and not self.abort_all:
            raise ValueError("give rid or abort_all=true")
        return self


class PauseRequest(_Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"
    rid: Optional[str] = None


# --- the RL loop's bodies: SGLang 0.5.23's io_struct fields. Fields that select something this
# engine does not have (a load format, async loads, a draft model) are accepted at their defaults.
def _only(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported (only {', '.join(map(repr, allowed))})")


class ContinueRequest(_Strict):
    torch_empty_cache: StrictBool = True
    rid: Optional[str] = None


class UpdateFromDiskRequest(_Strict):
    model_path: str = Field(min_length=1)
    load_format: Optional[str] = None
    abort_all_requests: StrictBool = False
    weight_version: Optional[str] = None
    is_async: StrictBool = False
    torch_empty_cache: StrictBool = False
    keep_pause: StrictBool = False
    recapture_cuda_graph: StrictBool = False     # in-place copies keep the graphs valid
    token_step: StrictInt = 0
    flush_cache: StrictBool = True
    manifest: Optional[dict[str, Any]] = None
    rid: Optional[str] = None

    @model_validator(mode="after")
    def _check(self):
        _only("load_format", self.load_format, (None, "auto", "safetensors"))
        _only("is_async", self.is_async, (False,))
        _only("manifest", self.manifest, (None,))
        return self


class InitGroupRequest(_Strict):
    master_address: str = Field(min_length=1)
    master_port: Union[StrictInt, str]     # AReaL sends a string; SGLang converts it
    rank_offset: StrictInt
    world_size: StrictInt
    group_name: str = Field(default="weight_update_group", min_length=1)
    backend: str = "nccl"
    pp_rank: StrictInt = 0                 # no pipeline stages here: only stage 0 exists
    rid: Optional[str] = None

    @model_validator(mode="after")
    def _check(self):
        port = self.master_port
        if isinstance(port, str):
            if not port.strip().isdigit():
                raise ValueError(f"master_port must be a port number, got {port!r}")
            port = self.master_port = int(port.strip())
        if not 1 <= port <= 65535:
            raise ValueError(f"master_port must be in [1, 65535], got {port}")
        if self.pp_rank != 0:
            raise ValueError(f"pp_rank={self.pp_rank} is not supported: this engine has one pipeline "
                             "stage (pp_size 1), so only pp_rank 0")
        return self


class UpdateFromDistributedRequest(_Strict):
    names: list[str] = Field(default_factory=list)
    dtypes: list[str] = Field(default_factory=list)
    shapes: list[list[StrictInt]] = Field(default_factory=list)
    # one tensor, SGLang's earlier singular fields (SkyRL's remote engine sends them)
    name: Optional[str] = None
    dtype: Optional[str] = None
    shape: Optional[list[StrictInt]] = None
    group_name: str = "weight_update_group"
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: Optional[str] = None
    load_format: Optional[str] = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: StrictBool = False
    rid: Optional[str] = None

    @model_validator(mode="after")
    def _check(self):
        _only("load_format", self.load_format, (None,))
        _only("selector", self.selector, ("all", "target"))   # no draft model here
        single = (self.name, self.dtype, self.shape)
        if any(x is not None for x in single):
            if any(x is None for x in single) or self.names or self.dtypes or self.shapes:
                raise ValueError("give name, dtype and shape together (one tensor), or names, dtypes and shapes")
            self.names, self.dtypes, self.shapes = [self.name], [self.dtype], [self.shape]
        elif not self.names:
            raise ValueError("names, dtypes and shapes are required (or name, dtype and shape for one tensor)")
        return self


class UpdateFromTensorRequest(_Strict):
    # one base64 pickle per rank, or one for all (engine/runtime/tensor_payload.py reads them)
    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: Optional[str] = None
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: Optional[str] = None
    rid: Optional[str] = None

    @model_validator(mode="after")
    def _check(self):
        _only("load_format", self.load_format, (None, "direct", "flattened_bucket"))
        return self


class DestroyGroupRequest(_Strict):
    group_name: str = "weight_update_group"
    rid: Optional[str] = None


class UpdateWeightVersionRequest(_Strict):
    new_version: str = Field(min_length=1)
    abort_all_requests: StrictBool = True
    rid: Optional[str] = None


class MemoryRequest(_Strict):
    tags: Optional[list[str]] = None
    rid: Optional[str] = None


class RolloutFinishRequest(_Strict):
    rollout_id: str = Field(min_length=1)


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class CompletionRequest(_Strict):
    """OpenAI `/v1/completions` with token-id prompts; `ignore_eos`, `top_k`, `stop_token_ids`,
    `min_tokens` and `rollout_id` are the usual vLLM/SGLang extensions."""

    model: Optional[str] = None
    prompt: Union[TokenIds, list[TokenIds], str, list[str]]
    max_tokens: Optional[StrictInt] = 16
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[StrictInt] = None
    min_tokens: Optional[StrictInt] = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[StrictInt] = None
    echo: StrictBool = False
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[TokenIds] = None
    ignore_eos: StrictBool = False
    seed: Optional[StrictInt] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    best_of: Optional[StrictInt] = None
    logit_bias: Optional[dict[str, float]] = None
    suffix: Optional[str] = None
    user: Optional[str] = None
    rollout_id: Optional[str] = None
    priority: StrictInt = Field(default=0, ge=-PRIORITY_MAX, le=PRIORITY_MAX)   # admission order, higher first

    @model_validator(mode="after")
    def _check(self):
        _neutral("n", self.n, (1,))
        _neutral("echo", self.echo, (False,))
        _neutral("best_of", self.best_of, (None, 1))
        _neutral("suffix", self.suffix, (None,))
        if self.logprobs is not None and not 0 <= self.logprobs <= 5:
            raise ValueError("logprobs must be between 0 and 5")
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt is empty")
        return self

    @property
    def batched(self) -> bool:
        return isinstance(self.prompt, list) and isinstance(self.prompt[0], (list, str))

    def sampling_params(self) -> dict[str, Any]:
        """SGLang `sampling_params` keys; the engine validates the values."""
        return openai_sampling_params(self, self.max_tokens, OPENAI_SAMPLING + (("logit_bias", "logit_bias"),))


# OpenAI request field -> SGLang sampling_params key, for fields both requests carry.
OPENAI_SAMPLING = (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                   ("min_tokens", "min_new_tokens"), ("seed", "seed"), ("stop", "stop"),
                   ("frequency_penalty", "frequency_penalty"), ("presence_penalty", "presence_penalty"))


def openai_sampling_params(req: Any, max_new_tokens: Optional[int],
                           fields: tuple[tuple[str, str], ...] = OPENAI_SAMPLING) -> dict[str, Any]:
    """An OpenAI-style request's sampling fields as SGLang `sampling_params` (unset ones left out)."""
    sp: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    for src, dst in fields:
        v = getattr(req, src)
        if v is not None:
            sp[dst] = v
    if req.stop_token_ids:
        sp["stop_token_ids"] = list(req.stop_token_ids)
    if req.ignore_eos:
        sp["ignore_eos"] = True
    return sp


def _clean_finish_reason(fr: Optional[dict]) -> Optional[dict]:
    if fr is None:
        return None
    return {k: v for k, v in fr.items() if v is not None or k == "type"}


def version_meta(spans: list, current: str, n_tokens: int) -> dict:
    """SGLang's `weight_version` (the version of the last token, or the engine's now) and
    `weight_versions` (one {version, start, end} per run of tokens one version produced)."""
    if not spans:
        return {"weight_version": current, "weight_versions": [{"version": current, "start": 0, "end": 0}]}
    shown = [{"version": v, "start": a, "end": min(b, n_tokens)} for v, a, b in spans if a < n_tokens or a == 0]
    return {"weight_version": shown[-1]["version"], "weight_versions": shown}


def generate_response(*, rid: str, output_ids: list[int], logprobs: Optional[list[float]],
                      finish_reason: Optional[dict], prompt_tokens: int, cached_tokens: int,
                      e2e_latency: Optional[float], text: str = "", versions: Optional[dict] = None,
                      routed_experts: Optional[bytes] = None) -> dict:
    """SGLang's `/generate` item: cumulative `output_ids`, `meta_info` with SGLang's keys."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": _clean_finish_reason(finish_reason),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(output_ids),
        "cached_tokens": cached_tokens,
        **(versions or {"weight_version": "default"}),
    }
    if routed_experts is not None:   # SGLang's encoding: base64 of int32 [positions, layers, top-k]
        meta["routed_experts"] = base64.b64encode(routed_experts).decode()
    if e2e_latency is not None:
        meta["e2e_latency"] = e2e_latency
    if logprobs is not None:
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(logprobs, output_ids)]
    return {"text": text, "output_ids": list(output_ids), "meta_info": meta}


def error_body(message: str, status: int) -> dict:
    """OpenAI's error shape, which the `openai` client and SGLang clients both read."""
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": status}}
