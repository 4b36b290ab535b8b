"""One attention replica's requests and KV accounting: the planner's side of a step, no tensors.

`plan_step()` applies the policy to a snapshot, admits and retracts (KV reservations), and returns
the launched step: the plan, the rows bound to the request lifetimes they were launched for, and
the rows as the rank-shared plan carries them (tokens, block tables). `apply_result()` takes the
sampled tokens back: results of an earlier lifetime are discarded, P promotes to D on its first
token, stop conditions finish requests, and every step emits incremental `RequestOutput`s.
The engine (runtime/engine.py) holds one Scheduler per replica; one rank is the world of one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..protocol.config import ControlSettings, EngineConfig, ModelConfig
from ..protocol.plan import Phase, ReplicaWork, RowSpec
from .kv_pool import BlockPool, BlockTable, Reservation, Reservations
from .policy import Plan, Snapshot, make_policy
from .request import Req, RequestError, RequestOutput, SamplingParams, Status
from .spec import propose_ngram


@dataclass
class Row:
    """One row of a launched step, bound to the request lifetime it was launched for."""
    req: Req
    reservation: Reservation
    lifetime: int
    kind: Phase          # DECODE | PREFILL
    length: int          # tokens computed by this row
    samples: bool        # produces a token
    draft: int = 0       # a verify row: draft tokens after the row's token


@dataclass
class Launched:
    plan: Plan
    rows: list[Row]
    work: ReplicaWork    # the same rows in the rank-shared plan's form
    t0: float
    decode_waits: list[float]
    spec: list = None    # [verify rows, drafts proposed, drafts accepted] of this step (apply_result)

    def split(self) -> tuple["Launched", "Launched"]:
        """(D part, P part): results of a P epoch in flight come back steps after D's."""
        d = [r for r in self.rows if r.kind is Phase.DECODE]
        p = [r for r in self.rows if r.kind is not Phase.DECODE]
        return (Launched(self.plan, d, ReplicaWork(self.work.decode, ()), self.t0, self.decode_waits, self.spec),
                Launched(self.plan, p, ReplicaWork((), self.work.prefill), self.t0, [], [0, 0, 0]))


class Scheduler:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, num_blocks: int, proposer=None,
                 clock=time.monotonic) -> None:
        """`proposer`: a model proposer (runtime/draft.py: `propose`, `adopt`, `peek`); None: n-gram.
        `clock`: arrivals, waits and the planner's now (a simulator's virtual clock: e2e/plan_sim.py)."""
        self.config, self.model_config = config, model_config
        self.clock = clock
        self.hold_until: float | None = None   # the last plan held waiting work back until then
        self.pool = BlockPool(num_blocks, config.block_size)
        self.reservations = Reservations(self.pool)
        self.max_context_len = min(model_config.max_position_embeddings, config.max_context_len or 1 << 62)
        self.policy = make_policy(config.mode)
        self.reqs: dict[str, Req] = {}       # every unfinished request, by rid
        self.waiting: list[Req] = []         # FCFS
        self.step_id = 0
        self._outbox: list[RequestOutput] = []
        self.weight_version = "default"     # tags every token this replica emits from now on
        self.spec_k = config.speculative_k if config.speculative else 0
        self._drafts: dict[str, list[int]] = {}   # this step's proposals, by decode rid (with KV for them)
        self.proposer = proposer
        # The MTP head needs the target's hidden state at every position it has no entry for, and a
        # prefix-cache hit skips computing those: under mtp the target reuses only what the head
        # adopted from the request's earlier turn (runtime/draft.py)
        self.head_caps_prefix = config.speculative == "mtp"

    # --- requests ---------------------------------------------------------------------------
    def check(self, rid: str, input_ids: list[int], sampling: SamplingParams) -> None:
        """Raises RequestError for input this replica cannot take; changes nothing."""
        if not isinstance(rid, str) or not rid:
            raise RequestError("rid must be a non-empty string")
        try:   # every rank hashes it (a seed, the step log's digest): a lone surrogate has no bytes
            rid.encode()
        except UnicodeEncodeError as e:
            raise RequestError(f"rid is not valid Unicode text: {e.reason} at character {e.start}") from None
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

    def submit(self, rid: str, input_ids: list[int], sampling: SamplingParams, return_logprob: bool = False,
               rollout_id: str | None = None, routes_from: int | None = None, priority: int = 0) -> None:
        self.check(rid, input_ids, sampling)
        if routes_from is not None and not 0 <= routes_from <= len(input_ids):
            raise RequestError(f"routed_experts_start_len must be in [0, {len(input_ids)}] "
                               f"(the prompt's tokens), got {routes_from}")
        req = Req(rid, list(input_ids), sampling, return_logprob, rollout_id, priority=priority,
                  arrival=self.clock(), routes_from=routes_from)
        self.reqs[rid] = req
        self.waiting.append(req)

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

    def flush_cache(self, allow_waiting: bool = False) -> bool:
        """Drops cached prefix blocks: only with no request holding KV (and, unless allowed, none
        waiting: a paused engine's retracted requests are recomputed anyway)."""
        if self.holds_kv() or (self.reqs and not allow_waiting):
            return False
        self.pool.flush()
        return True

    def drop_cached(self) -> int:
        """After a weight change: every cached block nobody holds (running requests keep theirs)."""
        return self.pool.flush()

    def holds_kv(self) -> bool:
        return any(r.reservation is not None for r in self.reqs.values())

    def retract_all(self) -> int:
        """Every request holding KV gives it back and waits, first in line, to be recomputed
        (SGLang's pause mode `retract`); returns how many."""
        held = sorted((r for r in self.reqs.values() if r.reservation is not None), key=lambda r: r.arrival)
        for r in held:
            self.reservations.close(r.reservation)
            r.reservation, r.status, r.computed, r.route_parts = None, Status.WAITING, 0, []
            r.retractions += 1
        self.waiting[:0] = held
        return len(held)

    # --- one step ---------------------------------------------------------------------------
    def plan_step(self, control: ControlSettings, p_busy: bool = False) -> Launched | None:
        """Plan, admission and the rows to run; None for an empty step. `p_busy`: a P epoch is in
        flight (pd on several ranks): plan D only, the policy sees no prefill work."""
        plan = self.policy.plan(self.step_id, self._snapshot(p_busy), control)
        self.step_id += 1
        self._apply_admission(plan)
        self.hold_until = plan.hold_until
        if plan.empty:
            return None
        t0 = self.clock()
        waits = [t0 - self.reqs[rid].d_ready_at for rid in plan.decode if self.reqs[rid].d_ready_at]
        rows, decode, prefill = [], [], []
        for rid in plan.decode:
            r = self.reqs[rid]
            drafts = self._drafts.pop(rid, [])
            rows.append(Row(r, r.reservation, r.lifetime, Phase.DECODE, 1, True, len(drafts)))
            spec = self._spec(r, Phase.DECODE, len(r.tokens) - 1, 1, True)
            if drafts:   # one D row over k + 1 positions: the row's token, then the drafts
                spec = RowSpec(spec.rid, spec.kind, spec.start, spec.tokens + tuple(drafts), spec.blocks,
                               True, spec.logprob, False, len(drafts))
            decode.append(spec)
        for seg in plan.prefill:
            r = self.reqs[seg.rid]
            rows.append(Row(r, r.reservation, r.lifetime, Phase.PREFILL, seg.length, seg.completes))
            prefill.append(self._spec(r, Phase.PREFILL, seg.start, seg.length, seg.completes))
        for row in rows:
            self.reservations.begin_work(row.reservation)   # submitted from here on
        return Launched(plan, rows, ReplicaWork(tuple(decode), tuple(prefill)), t0, waits, [0, 0, 0])

    @staticmethod
    def _spec(r: Req, kind: Phase, start: int, n: int, samples: bool) -> RowSpec:
        return RowSpec(r.rid, kind, start, tuple(r.tokens[start:start + n]), r.reservation.blocks.frozen(),
                       samples, r.return_logprob, r.routes_from is not None)

    def apply_result(self, launched: Launched, tokens: dict, now: float, routes: dict | None = None) -> None:
        """`tokens`: rid -> (token, logprob | None) for the rows that sample; `routes`: rid -> the
        routed rows' expert ids (bytes)."""
        for row in launched.rows:
            self.reservations.end_work(row.reservation)
            if not self.reservations.is_current(row.req.rid, row.lifetime) or self.reqs.get(row.req.rid) is not row.req:
                continue    # an earlier lifetime's result: discard
            token, logprob = tokens.get(row.req.rid, (None, None)) if row.samples else (None, None)
            if routes and row.req.rid in routes:
                row.req.route_parts.append(routes[row.req.rid])
            if row.draft:
                self._apply_verify(row, token, logprob, now, launched.spec)
                continue
            if self.spec_k and row.kind == Phase.DECODE:
                row.req.spec_verify_ct += 1     # a D iteration of this request with nothing to verify
                launched.spec[0] += 1
            self._apply_row(row, token, logprob, now)

    def outputs(self) -> list[RequestOutput]:
        out, self._outbox = self._outbox, []
        return out

    # --- internals --------------------------------------------------------------------------
    def _snapshot(self, p_busy: bool = False) -> Snapshot:
        prefilling = [] if p_busy else [r for r in self.reqs.values() if r.status is Status.PREFILL]
        decoding = [r for r in self.reqs.values() if r.status is Status.DECODE]
        waiting = [] if p_busy else self.waiting
        hint = {r.rid: self._prefix_hint(r) for r in waiting}
        return Snapshot(waiting, prefilling, decoding, self.pool.num_available(),
                        self.pool.block_size, self.config.max_running, self.config.mixed_chunk_tokens, hint,
                        self.clock(), self.config.p_idle_gather_ms)

    def _prefix_hint(self, r: Req) -> tuple[int, int]:
        if r.routes_from is not None:
            return 0, 0      # routing is reported per computed position: no prefix reuse
        limit = len(r.tokens) - 1
        if self.head_caps_prefix:
            limit = min(limit, self.proposer.peek(r.rid, r.tokens))
        hits, shared = self.pool.peek_prefix(r.tokens, limit)
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
            limit = target - 1
            if self.proposer is not None:   # its entries from the request's earlier turn
                adopted = self.proposer.adopt(rid, list(r.tokens))   # it keeps them: a snapshot
                if self.head_caps_prefix:
                    limit = min(limit, adopted)
            res.blocks = BlockTable([] if r.routes_from is not None else self.pool.match_prefix(r.tokens, limit, res.chain))
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
        if self.spec_k:
            wants = []
            for rid in plan.decode:   # at most max_new_tokens - 1 more than the row's token
                r = self.reqs[rid]
                k = min(self.spec_k, r.sampling.max_new_tokens - len(r.output) - 1)
                if k > 0 and r.routes_from is None:   # routing is reported per computed position
                    wants.append((rid, list(r.tokens), k))   # the proposer keeps them: a snapshot
            if self.proposer is not None:
                found = self.proposer.propose(wants, set(self.reqs))
            else:
                found = {rid: propose_ngram(toks, k) for rid, toks, k in wants}
            for rid, drafts in found.items():
                self._take(self.reqs[rid], drafts)

    def _take(self, r: Req, drafts: list[int]) -> None:
        """KV slots for a decode row's drafts from what the plan left free: drafts never retract or
        delay anyone (they shrink to the free blocks)."""
        res, bs = r.reservation, self.pool.block_size
        room = (len(res.blocks) + self.pool.num_available()) * bs - len(r.tokens)
        drafts = drafts[:max(0, room)]
        if not drafts:
            return
        more = self.pool.blocks_for(len(r.tokens) + len(drafts)) - len(res.blocks)
        if more > 0:
            res.blocks += self.pool.allocate(more)
        self._drafts[r.rid] = drafts

    def _apply_verify(self, row: Row, toks: tuple, lps: tuple | None, now: float, counts: list) -> None:
        """A verify row's result: the accepted drafts and the target's next token, emitted one by one
        up to a stop; the KV of rejected positions is rolled back (their blocks go back to the pool)."""
        r = row.req
        r.spec_verify_ct += 1
        r.spec_proposed += row.draft
        r.spec_accepted += len(toks) - 1
        counts[0] += 1
        counts[1] += row.draft
        counts[2] += len(toks) - 1
        reason = None
        for i, t in enumerate(toks):
            r.output.append(t)
            if r.return_logprob:
                r.logprobs.append(lps[i])
            reason = self._stop_reason(r, t)
            if reason is not None:
                break
        # KV is valid for every position but the last emitted token's (as after a plain decode row)
        r.computed = len(r.tokens) - 1
        res = r.reservation
        self.pool.commit(res.blocks, r.tokens, r.computed, res.chain)
        keep = self.pool.blocks_for(r.computed)
        if len(res.blocks) > keep:   # rollback: slots past the KV held a rejected draft
            self.pool.release(res.blocks[keep:])
            del res.blocks[keep:]
        if r.first_token_at is None:
            r.first_token_at = now
        r.d_ready_at = now
        if reason is not None:
            self._finish(r, reason)
        else:
            self._emit(r, finished=False, reason=None)

    def _apply_row(self, row: Row, token, logprob, now: float) -> None:
        r = row.req
        r.computed += row.length
        self.pool.commit(r.reservation.blocks, r.tokens, r.computed, r.reservation.chain)
        if row.kind == Phase.PREFILL and not row.samples:
            return
        if row.kind == Phase.PREFILL:
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
        routed = None
        if finished and r.routes_from is not None:
            per = self.model_config.num_hidden_layers * self.model_config.num_experts_per_tok * 4
            routed = b"".join(r.route_parts)[r.routes_from * per:]
        spec = (r.spec_verify_ct, r.spec_proposed, r.spec_accepted) if self.spec_k else None
        self._outbox.append(RequestOutput(r.rid, new, lps, finished, reason, len(r.prompt), len(r.output),
                                          r.cached_tokens, r.rollout_id, self.weight_version, routed, spec))

    # --- introspection ----------------------------------------------------------------------
    def stats(self) -> dict:
        running = sum(1 for r in self.reqs.values() if r.status in (Status.PREFILL, Status.DECODE))
        return {"num_running_reqs": running, "num_queue_reqs": len(self.waiting),
                "token_usage": self.pool.num_used() / self.pool.num_blocks,
                "kv_blocks_total": self.pool.num_blocks, "kv_blocks_used": self.pool.num_used(),
                "kv_blocks_cached": len(self.pool.evictable)}
