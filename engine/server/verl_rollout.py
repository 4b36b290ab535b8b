"""verl's rollout against a pdrollout server (docs/SERVER.md, "verl").

verl drives SGLang in-process: its `SGLangHttpServer` actor calls SGLang's tokenizer manager for
`generate`, and its `ServerAdapter` (in each hybrid worker) releases and resumes memory and pushes
weights with SGLang's `update_weights_from_tensor`. `PdrolloutRollout` is both sides over HTTP, with
the methods and return shapes verl calls (verl 0.9.1: `BaseRollout.resume(tags)`, `release()`,
`update_weights(weights, global_steps=...)`; the server actor's `generate(prompt_ids,
sampling_params, request_id, ...) -> TokenOutput`). It needs only aiohttp and torch; with verl
installed it is a `BaseRollout` and `generate` returns verl's `TokenOutput`.

Weights go as SGLang's flattened buckets (one entry for all ranks: every engine rank keeps its
shard): CUDA tensors as IPC handles (the trainer on the server's GPUs, verl's colocated mode), CPU
tensors by value. The admin token, when the server has one, goes as a bearer token on the routes
that change the engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, Optional

import aiohttp
import torch

from ..runtime.tensor_payload import flattened_bucket, serialize, serialize_by_value

try:   # verl's own base and output types when verl is installed
    from verl.workers.rollout.base import BaseRollout as _Base
    from verl.workers.rollout.replica import TokenOutput as _VerlTokenOutput
except ImportError:
    _Base, _VerlTokenOutput = object, None


@dataclass
class TokenOutput:
    """verl's TokenOutput fields (verl/workers/rollout/replica.py)."""
    token_ids: list
    log_probs: Optional[list] = None
    routed_experts: Any = None
    stop_reason: Optional[str] = None     # "completed" | "aborted" | None
    num_preempted: Optional[int] = None
    extra_fields: dict = field(default_factory=dict)


class RolloutError(RuntimeError):
    """The server refused a call (its status and message)."""


class PdrolloutRollout(_Base):
    def __init__(self, url: str, *, admin_token: str | None = None, bucket_megabytes: float = 512,
                 free_cache_engine: bool = True, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.admin_token = admin_token
        self.bucket_bytes = int(bucket_megabytes * (1 << 20))
        self.free_cache_engine = free_cache_engine   # verl's rollout.free_cache_engine
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.global_steps: int | None = None

    # ---- HTTP ---------------------------------------------------------------------------------
    async def _call(self, method: str, path: str, body: dict | None = None, admin: bool = False):
        headers = {"Authorization": f"Bearer {self.admin_token}"} if admin and self.admin_token else {}
        async with aiohttp.ClientSession(timeout=self.timeout) as s:
            async with s.request(method, self.url + path, json=body, headers=headers) as r:
                out = await r.json(content_type=None)
                if r.status != 200:
                    msg = out.get("message") or out.get("error", {}).get("message") if isinstance(out, dict) else out
                    raise RolloutError(f"{method} {path}: {r.status}: {msg}")
                return out

    # ---- verl's BaseRollout -----------------------------------------------------------------
    async def resume(self, tags: list[str]) -> None:
        if self.free_cache_engine:
            await self._call("POST", "/resume_memory_occupation", {"tags": tags}, admin=True)

    async def release(self) -> None:
        if self.free_cache_engine:
            await self._call("POST", "/release_memory_occupation", {"tags": ["kv_cache", "weights"]}, admin=True)

    async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None,
                             **kwargs) -> None:
        """Full (name, tensor) pairs, checkpoint key names, in buckets, then a cache flush (as
        verl's ServerAdapter); the new weight version is the step (the last bucket carries it)."""
        if kwargs.get("peft_config") and kwargs.get("base_sync_done"):
            raise NotImplementedError("LoRA adapters are not served by pdrollout: sync merged weights")
        pending = None
        async for bucket in _buckets(weights, self.bucket_bytes):
            if pending is not None:
                await self._push(pending, version=None)
            pending = bucket
        if pending is not None:
            await self._push(pending, version=None if global_steps is None else str(global_steps))
        await self.clear_kv_cache()
        self.global_steps = global_steps

    async def _push(self, bucket: list, version: str | None) -> None:
        payload = flattened_bucket(bucket)   # kept alive until the answer: CUDA IPC handles point into it
        on_cuda = payload["flattened_tensor"].is_cuda
        entry = serialize(payload) if on_cuda else serialize_by_value(payload)
        body = {"serialized_named_tensors": [entry], "load_format": "flattened_bucket", "flush_cache": True}
        if version is not None:
            body["weight_version"] = version
        await self._call("POST", "/update_weights_from_tensor", body, admin=True)
        if on_cuda:
            torch.cuda.synchronize()

    # ---- verl's server actor ------------------------------------------------------------------
    async def sleep(self) -> None:
        await self.release()

    async def wake_up(self) -> None:   # colocated mode: everything back, then a clean cache
        await self.resume(["kv_cache", "weights"])
        await self.clear_kv_cache()

    async def clear_kv_cache(self) -> None:
        await self._call("GET", "/flush_cache", admin=True)

    async def generate(self, prompt_ids, sampling_params: dict[str, Any], request_id: str,
                       image_data=None, video_data=None, **_) -> Any:
        """verl's `SGLangHttpServer.generate`: `logprobs` in sampling_params asks for the
        output tokens' logprobs; the answer is verl's TokenOutput."""
        if image_data or video_data:
            raise ValueError("image_data/video_data: pdrollout serves text models only")
        sp = dict(sampling_params)
        want_logprobs = bool(sp.pop("logprobs", False))
        if "max_tokens" in sp:
            sp["max_new_tokens"] = sp.pop("max_tokens")
        ids = prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
        out = await self._call("POST", "/generate", {"rid": request_id, "input_ids": ids, "sampling_params": sp,
                                                     "return_logprob": want_logprobs})
        meta = out["meta_info"]
        finish = (meta.get("finish_reason") or {}).get("type")
        fields = dict(token_ids=list(out["output_ids"]),
                      log_probs=[float(lp) for lp, _, _ in meta["output_token_logprobs"]] if want_logprobs else None,
                      stop_reason="aborted" if finish == "abort" else "completed",
                      extra_fields={"global_steps": self.global_steps, "weight_version": meta.get("weight_version")})
        return _VerlTokenOutput(**fields) if _VerlTokenOutput is not None else TokenOutput(**fields)


async def _items(weights) -> AsyncIterator[tuple[str, torch.Tensor]]:
    if hasattr(weights, "__aiter__"):
        async for x in weights:
            yield x
    else:
        for x in weights:
            yield x


async def _buckets(weights, limit: int) -> AsyncIterator[list]:
    """verl's bucketing: consecutive tensors up to `limit` bytes (a tensor over it goes alone)."""
    cur, size = [], 0
    async for name, t in _items(weights):
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > limit:
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += nbytes
    if cur:
        yield cur
