"""The planner: one plan per step, a plain data object (shared across ranks by the distributed
engine). Policies are small objects; the planner never touches tensors or the KV pool itself.

  normal  strict prefill priority: while any prefill can run, no decode runs (the paper's baseline)
  mixed   chunked prefill with the decode rows riding in the same step (SGLang/vLLM style)
  pd      decode first; prefill admitted into the remaining batch/KV capacity and cut into
          segments of span K; one decode iteration between segments

Every policy admits in the client's order: a higher `priority` (SGLang's field on /generate;
an RL client sets it to a trajectory's remaining work, so the critical path goes first), then
arrival. Under memory pressure the lowest-priority, youngest decode rows give their KV back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from ..protocol.config import ControlSettings
from ..protocol.turnstile import auto_span
from .request import Req, Status

SPAN_MAX = 4


@dataclass(frozen=True)
class PrefillSegment:
    rid: str
    start: int        # first token position computed by this segment
    length: int
    completes: bool   # reaches the end of the prefill target: samples the first new token


@dataclass(frozen=True)
class Plan:
    step: int
    decode: tuple[str, ...] = ()
    prefill: tuple[PrefillSegment, ...] = ()
    admit: tuple[str, ...] = ()        # waiting requests to take KV for before running
    retract: tuple[str, ...] = ()      # decode rows that give their KV back (memory pressure)
    span: int = 1
    multiplexing: bool = False         # P and D both in this step under the pd policy
    control: ControlSettings = field(default_factory=ControlSettings)
    # an empty plan that holds waiting work back on purpose: plan again by then, or when work arrives
    hold_until: float | None = None

    @property
    def prefill_tokens(self) -> int:
        return sum(s.length for s in self.prefill)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


@dataclass
class Snapshot:
    """What a policy sees: requests by state and KV capacity, read-only."""
    waiting: Sequence[Req]
    prefilling: Sequence[Req]
    decoding: Sequence[Req]
    free_blocks: int
    block_size: int
    max_running: int
    mixed_chunk_tokens: int
    # waiting rid -> (prefix-hit tokens, hit blocks already referenced by others). Hit blocks
    # that are only cached (unreferenced) still count against free blocks when taken.
    cached_hint: dict[str, tuple[int, int]] = field(default_factory=dict)
    now: float = field(default_factory=time.monotonic)   # the clock of Req.arrival
    idle_gather_ms: float | None = None                   # EngineConfig.p_idle_gather_ms

    def oldest_p_wait_s(self) -> float:
        """How long the longest-waiting request without its first token has waited."""
        started = [r.arrival for r in (*self.waiting, *self.prefilling) if r.first_token_at is None]
        return self.now - min(started) if started else 0.0

    def blocks_for(self, n: int) -> int:
        return -(-n // self.block_size)

    def decode_block_need(self, r: Req) -> int:
        # The next decode token lands at position len(tokens)-1; a new block when it starts one.
        return 1 if (len(r.tokens) - 1) % self.block_size == 0 else 0


class Policy(Protocol):
    name: str

    def plan(self, step: int, s: Snapshot, control: ControlSettings) -> Plan: ...


class _Builder:
    """Shared mechanics: decode rows with retraction under KV pressure, FCFS prefill admission."""

    def __init__(self, s: Snapshot):
        self.s = s
        self.free = s.free_blocks
        self.decode: list[str] = []
        self.retract: list[str] = []
        self.admit: list[str] = []
        self.segments: list[PrefillSegment] = []

    def take_decode(self) -> None:
        rows = sorted(self.s.decoding, key=lambda r: (-r.priority, r.arrival))
        need = [self.s.decode_block_need(r) for r in rows]
        # Retract the youngest rows until the rest fit: never corrupts a running row.
        while rows and sum(need) > self.free:
            self.retract.append(rows.pop().rid)
            need.pop()
        self.free -= sum(need)
        self.decode = [r.rid for r in rows]

    def take_prefill(self, budget: int, headroom: int = 0) -> None:
        running = len(self.decode) + len(self.s.prefilling)
        for r in sorted(self.s.prefilling, key=lambda r: (-r.priority, r.arrival)):
            if budget <= 0:
                return
            self._segment(r, budget)
            budget -= self.segments[-1].length
        # stable: equal priorities keep the queue's order (retracted rows first, then arrival)
        for r in sorted(self.s.waiting, key=lambda r: -r.priority):
            if budget <= 0 or running >= self.s.max_running:
                return
            target = len(r.tokens)
            hit, shared = self.s.cached_hint.get(r.rid, (0, 0))
            need = self.s.blocks_for(target) - shared
            if need + headroom > self.free:
                return          # in order: a later request never overtakes the head on KV
            self.free -= need
            self.admit.append(r.rid)
            running += 1
            self._segment(r, budget, start=hit)
            budget -= self.segments[-1].length

    def _segment(self, r: Req, budget: int, start: int | None = None) -> None:
        start = r.computed if start is None else start
        target = len(r.tokens)
        n = min(budget, target - start)
        self.segments.append(PrefillSegment(r.rid, start, n, start + n == target))

    def build(self, step, control, span=1, multiplexing=False) -> Plan:
        return Plan(step, tuple(self.decode), tuple(self.segments), tuple(self.admit),
                    tuple(self.retract), span, multiplexing, control)


def _has_prefill_work(s: Snapshot) -> bool:
    return bool(s.prefilling or s.waiting)


class NormalPolicy:
    """Every pending prefill runs before any decode (while KV lets prefill make progress)."""
    name = "normal"

    def plan(self, step, s, control):
        b = _Builder(s)
        if _has_prefill_work(s):
            b.take_prefill(control.prefill_budget_tokens)
            if b.segments:
                return b.build(step, control)
            b = _Builder(s)   # no prefill fits in KV: decode so memory frees up
        b.take_decode()
        return b.build(step, control)


class MixedPolicy:
    """Chunked prefill: decode rows plus prefill up to a fixed per-step token chunk."""
    name = "mixed"

    def plan(self, step, s, control):
        b = _Builder(s)
        b.take_decode()
        b.take_prefill(max(s.mixed_chunk_tokens - len(b.decode), 1))
        return b.build(step, control)


SEGMENT_UNITS = 16     # with decode rows running, one span unit is budget/16 prefill tokens
IDLE_QUIET_MS = 2.0    # p_idle_gather_ms: arrivals this far apart end the burst


class PDPolicy:
    """Decode first; the P segment rides in the remaining capacity of the same step.

    With no decode row the whole prefill budget runs (nothing to protect). With decode rows the
    segment is span × budget/16 tokens, so one fused step stays a small multiple of a decode step;
    `auto` picks the span from D occupancy and P pressure with the turnstile's rule (one rule for
    one rank and many). Once the oldest request without its first token has waited past
    `p_wait_bound_ms`, the segment is the whole budget until it has its token: the bound on the
    TTFT tail that a fixed small segment cannot give under a long P backlog. With `p_burst_first`,
    while more requests wait for their first token than rows decode, P runs alone (`normal`'s
    step): a burst of first turns gets the GPU to itself, as under `normal`, instead of sharing it
    with the few rows that finished first."""
    name = "pd"

    def plan(self, step, s, control):
        if control.activation == "off":
            return NormalPolicy().plan(step, s, control)
        hold = self._idle_hold(s)
        if hold is not None:
            return Plan(step, control=control, hold_until=hold)
        b = _Builder(s)
        b.take_decode()
        budget = control.prefill_budget_tokens
        if not b.decode:
            b.take_prefill(budget)
            return b.build(step, control, SPAN_MAX, control.activation == "on")
        if control.p_burst_first and control.activation == "auto" and \
                len(s.waiting) + len(s.prefilling) > len(b.decode):
            p_only = _Builder(s)
            p_only.take_prefill(budget)
            if p_only.segments:
                return p_only.build(step, control)
        if self._defer_p(s, control):   # P waits for the top priority's D rows: never an empty plan
            return b.build(step, control, 1, control.activation == "on")
        pending = sum(r.prefill_remaining for r in s.prefilling) + sum(len(r.tokens) for r in s.waiting)
        if control.span == "auto":
            span = auto_span(len(b.decode) / s.max_running, pending / budget, SPAN_MAX)
        else:
            span = control.span
        segment = span * max(budget // SEGMENT_UNITS, 1)
        bound = control.p_wait_bound_ms
        if bound is not None and s.oldest_p_wait_s() * 1000.0 > bound:
            segment = budget
        # Headroom: one block per decode row so admitted P cannot starve the running D rows.
        b.take_prefill(segment, headroom=len(b.decode))
        both = bool(b.segments)
        return b.build(step, control, span, both or control.activation == "on")


    @staticmethod
    def _idle_hold(s: Snapshot) -> float | None:
        """With `p_idle_gather_ms` and an idle engine: until when arrivals are held (None: run now).
        They are held while the last came less than IDLE_QUIET_MS ago, at most the gather after
        the first."""
        gather = s.idle_gather_ms
        if gather is None or s.decoding or s.prefilling or not s.waiting:
            return None
        first = min(r.arrival for r in s.waiting)
        last = max(r.arrival for r in s.waiting)
        until = min(first + gather / 1e3, last + IDLE_QUIET_MS / 1e3)
        return until if s.now < until else None

    @staticmethod
    def _defer_p(s: Snapshot, control: ControlSettings) -> bool:
        """A step that carries P costs more than a decode-only one (eager, not a graph replay), so P
        with slack waits, up to `p_gather_ms`, to ride in one step with more P. Only P below the top
        priority has slack (the critical path's never waits); with no priorities given, none has."""
        gather = control.p_gather_ms
        if gather is None or s.prefilling or not s.waiting:
            return False
        top = max(r.priority for r in (*s.waiting, *s.decoding))
        return all(r.priority < top and (s.now - r.arrival) * 1000.0 < gather for r in s.waiting)


POLICIES = {"normal": NormalPolicy, "mixed": MixedPolicy, "pd": PDPolicy}


def make_policy(mode: str) -> Policy:
    try:
        return POLICIES[mode]()
    except KeyError:
        raise ValueError(f"unknown mode {mode!r} (one of {', '.join(POLICIES)})") from None
