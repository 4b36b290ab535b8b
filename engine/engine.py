"""The single-rank engine loop: planner → runner → postprocess.

`step()` = `finish(launch())`. The split exists because submitted work can be in flight when an
abort arrives (GPU streams, other ranks): a reservation is released only after its work drained,
and results that come back for an earlier lifetime of a request id are discarded.
"""
from __future__ import annotations

import time
import zlib

import torch

from .config import ControlSettings, EngineConfig, ModelConfig
from .kv_cache import BlockPool, KVCache, Reservations
from .checkpoint import random_model
from .loader import load_model
from .planner import Plan, Snapshot, make_policy
from .request import Req, RequestError, RequestOutput, SamplingParams, Status
from .runner import ModelRunner, StepResult
from .sampling import make_generator

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Engine:
    def __init__(self, config: EngineConfig, *, model=None):
        self.config = config
        self.model_config = ModelConfig.load(config.model)
        dtype = None if config.dtype == "auto" else _DTYPES[config.dtype]
        if model is None:
            model = (random_model(self.model_config, config.device, dtype or torch.bfloat16, config.seed)
                     if config.random_weights else load_model(config.model, device=config.device, dtype=dtype))
        self.model = model
        cfg = self.model_config
        self.dtype = next(self.model.parameters()).dtype
        attn = self.model.model.layers[0].self_attn
        bs = config.block_size
        per_block = KVCache.bytes_per_block(cfg.num_hidden_layers, bs, attn.kv_heads, cfg.head_dim, self.dtype)
        num_blocks = config.num_blocks or max(config.kv_cache_bytes // per_block, 1)
        self.kv = KVCache(cfg.num_hidden_layers, num_blocks, bs, attn.kv_heads, cfg.head_dim, self.dtype, config.device)
        self._init_state(num_blocks)
        self.runner = ModelRunner(self.model, self.kv, bs, config.device, max_batch=config.max_running,
                                  max_context_len=self.max_context_len, null_slot=self.kv.null_slot,
                                  cuda_graphs=config.cuda_graphs)

    def _init_state(self, num_blocks: int) -> None:
        """Request and KV bookkeeping (no tensors): also what the multi-rank planner keeps per replica."""
        cfg, config = self.model_config, self.config
        self.pool = BlockPool(num_blocks, config.block_size)
        self.reservations = Reservations(self.pool)
        self.max_context_len = min(cfg.max_position_embeddings, config.max_context_len or 1 << 62)
        self.policy = make_policy(config.mode)
        self.control = config.control
        self._pending_control: ControlSettings | None = None
        self.reqs: dict[str, Req] = {}       # every unfinished request, by rid
        self.waiting: list[Req] = []         # FCFS
        self.gens: dict[str, torch.Generator] = {}
        self.step_id = 0
        self.events: list[dict] = []         # per-step records, drained by the server's metrics
        self._outbox: list[RequestOutput] = []
        self._inflight: list[tuple[Plan, StepResult, float]] = []

    # --- requests ---------------------------------------------------------------------------
    def submit(self, rid: str, input_ids: list[int], sampling: SamplingParams,
               return_logprob: bool = False, rollout_id: str | None = None) -> None:
        if not isinstance(rid, str) or not rid:
            raise RequestError("rid must be a non-empty string")
        if rid in self.reqs:
            raise RequestError(f"request id {rid!r} is already running")
        if not isinstance(input_ids, list) or not input_ids:
            raise RequestError("input_ids must be a non-empty list of token ids")
        vocab = self.model_config.vocab_size
        for t in input_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise RequestError(f"input_ids contains {t!r}, outside the vocabulary [0, {vocab})")
        total = len(input_ids) + sampling.max_new_tokens
        if total > self.max_context_len:
            raise RequestError(f"prompt ({len(input_ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) "
                               f"= {total} exceeds the context length {self.max_context_len}")
        if self.pool.blocks_for(total) > self.pool.num_blocks:
            raise RequestError(f"prompt + max_new_tokens = {total} tokens exceeds the KV cache capacity "
                               f"({self.pool.num_blocks * self.pool.block_size} tokens)")
        # The generator first: a request must not be registered if it cannot be (it would fail a step).
        gen = make_generator(sampling, self.config.seed ^ zlib.crc32(rid.encode()))
        req = Req(rid, list(input_ids), sampling, return_logprob, rollout_id)
        self.reqs[rid] = req
        self.waiting.append(req)
        self.gens[rid] = gen

    def abort(self, rid: str, message: str = "aborted") -> bool:
        req = self.reqs.get(rid)
        if req is None:
            return False
        self._finish(req, {"type": "abort", "message": message})
        return True

    def abort_all(self) -> int:
        return sum(self.abort(rid) for rid in list(self.reqs))

    def has_unfinished(self) -> bool:
        return bool(self.reqs) or bool(self._outbox)

    def set_control(self, control: ControlSettings) -> None:
        self._pending_control = control       # applied at the next step boundary

    @property
    def requested_control(self) -> ControlSettings:
        """The settings the next step will run with (a pending change, else the current ones)."""
        return self._pending_control or self.control

    def flush_cache(self) -> bool:
        if self.reqs:
            return False
        self.pool.flush()
        return True

    # --- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        return self.finish(self.launch())

    def launch(self):
        planned = self.plan_step()
        if planned is None:
            return None
        plan, t0, waits = planned
        result = self.runner.run(plan, self.reqs, self.gens)
        self.events.append({"step": plan.step, "t": t0, "decode_rows": len(plan.decode),
                            "prefill_tokens": plan.prefill_tokens, "decode_wait_s": waits,
                            "multiplexing_active": plan.multiplexing, "span": plan.span,
                            "mode": self.policy.name})
        return plan, result, t0

    def plan_step(self):
        """Control change, plan, admission: everything of a step before the forward.
        Returns (plan, t0, decode waits) or None for an empty plan."""
        if self._pending_control is not None:
            self.control, self._pending_control = self._pending_control, None
        plan = self.policy.plan(self.step_id, self._snapshot(), self.control)
        self.step_id += 1
        self._apply_admission(plan)
        if plan.empty:
            return None
        t0 = time.monotonic()
        waits = [t0 - self.reqs[rid].d_ready_at for rid in plan.decode if self.reqs[rid].d_ready_at]
        for rid in (*plan.decode, *(s.rid for s in plan.prefill)):
            self.reservations.begin_work(self.reqs[rid].reservation)   # submitted from here on
        return plan, t0, waits

    def finish(self, launched) -> list[RequestOutput]:
        if launched is not None:
            plan, result, t0 = launched
            now = time.monotonic()
            self.events[-1]["duration_s"] = now - t0
            self.apply_result(result, now)
        out, self._outbox = self._outbox, []
        return out

    def apply_result(self, result: StepResult, now: float) -> None:
        for i, row in enumerate(result.rows):
            self.reservations.end_work(row.reservation)
            if not self.reservations.is_current(row.req.rid, row.lifetime) or self.reqs.get(row.req.rid) is not row.req:
                continue    # an earlier lifetime's result: discard
            self._apply_row(row, result.tokens.get(i), result.logprobs.get(i), now)

    # --- internals --------------------------------------------------------------------------
    def _snapshot(self) -> Snapshot:
        prefilling = [r for r in self.reqs.values() if r.status is Status.PREFILL]
        decoding = [r for r in self.reqs.values() if r.status is Status.DECODE]
        hint = {r.rid: self._prefix_hint(r) for r in self.waiting}
        return Snapshot(self.waiting, prefilling, decoding, self.pool.num_available(),
                        self.pool.block_size, self.config.max_running, self.config.mixed_chunk_tokens, hint)

    def _prefix_hint(self, r: Req) -> tuple[int, int]:
        hits, shared = self.pool.peek_prefix(r.tokens, len(r.tokens) - 1)
        return hits * self.pool.block_size, shared

    def _apply_admission(self, plan: Plan) -> None:
        for rid in plan.retract:
            r = self.reqs[rid]
            self.reservations.close(r.reservation)
            r.reservation, r.status, r.computed = None, Status.WAITING, 0
            self.waiting.insert(0, r)      # first in line when KV frees up
        for rid in plan.admit:
            r = self.reqs[rid]
            self.waiting.remove(r)
            res = self.reservations.open(rid)
            target = len(r.tokens)
            res.blocks = self.pool.match_prefix(r.tokens, target - 1, res.chain)
            hit = len(res.blocks) * self.pool.block_size
            fresh = self.pool.allocate(self.pool.blocks_for(target) - len(res.blocks))
            if fresh is None:
                raise RuntimeError("planner admitted a request the KV pool cannot hold")
            res.blocks += fresh
            r.reservation, r.status, r.computed = res, Status.PREFILL, hit
            if not r.output:
                r.cached_tokens = hit
        for rid in plan.decode:
            r = self.reqs[rid]
            if self.pool.blocks_for(len(r.tokens)) > len(r.reservation.blocks):
                got = self.pool.allocate(1)
                if got is None:
                    raise RuntimeError("planner scheduled a decode row the KV pool cannot extend")
                r.reservation.blocks += got

    def _apply_row(self, row, token, logprob, now) -> None:
        r = row.req
        r.computed += row.length
        self.pool.commit(r.reservation.blocks, r.tokens, r.computed, r.reservation.chain)
        if row.kind == "prefill" and not row.samples:
            return
        if row.kind == "prefill":
            r.status = Status.DECODE
        r.output.append(token)
        if r.return_logprob:
            r.logprobs.append(logprob)
        if r.first_token_at is None:
            r.first_token_at = now
        r.d_ready_at = now
        reason = self._stop_reason(r, token)
        if reason is not None:
            self._finish(r, reason)
        else:
            self._emit(r, finished=False, reason=None)

    def _stop_reason(self, r: Req, token: int) -> dict | None:
        sp = r.sampling
        n = len(r.output)
        if n >= sp.min_new_tokens:
            if token in sp.stop_token_ids:
                return {"type": "stop", "matched": token}
            if not sp.ignore_eos and token in self.model_config.eos_token_ids:
                return {"type": "stop", "matched": token}
        if n >= sp.max_new_tokens:
            return {"type": "length", "length": n}
        return None

    def _finish(self, r: Req, reason: dict) -> None:
        del self.reqs[r.rid]
        self.gens.pop(r.rid, None)
        if r in self.waiting:
            self.waiting.remove(r)
        if r.reservation is not None:
            self.reservations.close(r.reservation)
        r.status = Status.FINISHED
        self._emit(r, finished=True, reason=reason)

    def _emit(self, r: Req, finished: bool, reason: dict | None) -> None:
        new = r.output[r.emitted:]
        lps = r.logprobs[r.emitted:] if r.return_logprob else None
        r.emitted = len(r.output)
        self._outbox.append(RequestOutput(r.rid, new, lps, finished, reason, len(r.prompt), len(r.output),
                                          r.cached_tokens, r.rollout_id))

    # --- introspection ----------------------------------------------------------------------
    def stats(self) -> dict:
        running = sum(1 for r in self.reqs.values() if r.status in (Status.PREFILL, Status.DECODE))
        return {"num_running_reqs": running, "num_queue_reqs": len(self.waiting),
                "token_usage": self.pool.num_used() / self.pool.num_blocks,
                "kv_blocks_total": self.pool.num_blocks, "kv_blocks_used": self.pool.num_used(),
                "kv_blocks_cached": len(self.pool.evictable), "step": self.step_id}

    def model_info(self) -> dict:
        c = self.model_config
        return {"model_path": self.config.model, "vocab_size": c.vocab_size, "max_context_len": self.max_context_len,
                "eos_token_ids": list(c.eos_token_ids), "num_experts": c.num_experts,
                "num_layers": c.num_hidden_layers, "dtype": str(self.dtype).removeprefix("torch."),
                "device": self.config.device, "mode": self.policy.name, "is_generation": True}
