"""Prometheus metrics of one server: the one place that names them (`pdrollout:` prefix, the same
meanings as SGLang's `sglang:` metrics, plus the P/D multiplexing signals).

Each server owns a CollectorRegistry, so several servers can live in one process (tests).
prometheus-client metrics are thread-safe: the engine thread records step events and engine
stats, the event loop records request latencies and token counts.
"""
from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..protocol import metrics as metric
from ..protocol.records import StepRecord
from ..runtime.node import RankCollector

P = metric.PREFIX

_LATENCY = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0,
            20.0, 40.0, 60.0, 120.0, 300.0)
_SHORT = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_STEP = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)
_MAKESPAN = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, registry: Optional[CollectorRegistry] = None):
        self.registry = r = registry or CollectorRegistry()
        # Load (the three the Gateway API inference extension routes on).
        self.num_running = Gauge(P + "num_running_reqs", "Requests holding KV (prefill or decode)", registry=r)
        self.num_queue = Gauge(P + "num_queue_reqs", "Requests waiting for admission", registry=r)
        self.token_usage = Gauge(P + "token_usage", "Fraction of KV blocks held by requests", registry=r)
        self.paused = Gauge(P + "paused", "1 while generation is paused (/pause_generation)", registry=r)
        # Requests.
        self.ttft = Histogram(metric.TTFT, "Arrival to first output token",
                              buckets=_LATENCY, registry=r)
        self._recent_ttft: deque[float] = deque(maxlen=metric.TTFT_WINDOW)
        self._recent_lock = threading.Lock()
        Gauge(metric.TTFT_RECENT_P99, f"Exact p99 of the last {metric.TTFT_WINDOW} requests' time to first token "
              "(NaN before the first)", registry=r).set_function(self.recent_ttft_p99)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Gap between output tokens",
                             buckets=_SHORT, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(P + "cached_tokens", "Prompt tokens found in the prefix cache", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Output tokens generated", registry=r)
        self.requests = Counter(P + "requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        # Planner and turnstile (from the engine's per-step records).
        self.steps = Counter(P + "engine_steps", "Engine steps that ran work", registry=r)
        # the D iteration's own cost (a P epoch may run beside it, on several ranks or with solo_overlap)
        self.decode_step = Histogram(metric.DECODE_STEP, "Wall time of steps with decode rows and no prefill tokens",
                                     buckets=_STEP, registry=r)
        # of those, the steps a P epoch ran beside: what P's overlap costs D's iteration
        self.decode_step_beside_p = Histogram(metric.DECODE_STEP_BESIDE_P,
                                              "Wall time of decode-only steps with a P epoch in flight beside them",
                                              buckets=_STEP, registry=r)
        # P epochs beside D (one rank, solo_overlap): where an epoch's time goes (records.PEpoch)
        self.p_epoch = Histogram(metric.P_EPOCH, "P epoch beside D: planned to its logits complete",
                                 buckets=_STEP, registry=r)
        self.p_epoch_enqueue = Histogram(metric.P_EPOCH_ENQUEUE, "P epoch: its forward's kernels issued, first to last",
                                         buckets=_STEP, registry=r)
        self.p_epoch_cpu = Histogram(metric.P_EPOCH_CPU, "P epoch: its thread's CPU time while issuing",
                                     buckets=_STEP, registry=r)
        self.decode_wait = Histogram(metric.DECODE_WAIT, "Decode row ready to its step started (planner)",
                                     buckets=_SHORT, registry=r)
        self.turnstile_wait = Histogram(metric.TURNSTILE_WAIT,
                                        "D ready at a turnstile round to D enqueued (P to its boundary, rendezvous)",
                                        buckets=_SHORT, registry=r)
        self.graph_steps = Counter(P + "graph_steps", "Steps whose D ran as a CUDA graph replay", registry=r)
        self.rendezvous = Histogram(metric.RENDEZVOUS, "One turnstile rendezvous",
                                    buckets=_SHORT, registry=r)
        self.rounds = Counter(metric.ROUNDS, "Turnstile rounds (D ordered inside a P epoch)", registry=r)
        self.spec_verify = Counter(metric.SPEC_VERIFY, "Decode rows run under speculation (each emits >= 1 token)",
                                   registry=r)
        self.spec_proposed = Counter(metric.SPEC_PROPOSED, "Draft tokens proposed for verification", registry=r)
        self.spec_accepted = Counter(metric.SPEC_ACCEPTED, "Draft tokens the target accepted", registry=r)
        self.stalls = Counter(metric.STALLS, "Collective stalls detected", registry=r)
        self.jit_compiles = Counter(metric.JIT_COMPILES, "Triton kernel compiles during served steps "
                                    "(each stalls its step; none expected after warm-up)", registry=r)
        self.multiplexing = Gauge(P + "multiplexing_active", "1 if the last step multiplexed P and D", registry=r)
        self.span = Gauge(P + "segment_span", "Segment span K of the last step", registry=r)
        # Rollouts (makespan of a client-declared batch of requests).
        self.rollout_makespan = Gauge(metric.ROLLOUT_MAKESPAN,
                                      "Makespan of the most recently finished rollout", registry=r)
        self.rollout_makespan_hist = Histogram(P + "rollout_makespan_seconds_hist", "Makespan of finished rollouts",
                                               buckets=_MAKESPAN, registry=r)
        self.rollout_requests = Gauge(P + "rollout_requests", "Requests of the most recently finished rollout",
                                      registry=r)
        self.rollouts_finished = Counter(metric.ROLLOUTS_FINISHED, "Finished rollouts", registry=r)
        self.rollouts_active = Gauge(P + "rollouts_active", "Rollouts with requests not yet finished", registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def add_ranks(self, counters, codes, layout) -> None:
        """Export this node's ranks (`node.RankCounters`; `codes()`: rank -> exit code or None)."""
        self.registry.register(RankCollector(counters, codes, layout))

    # --- event loop -------------------------------------------------------------------------
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        with self._recent_lock:
            self._recent_ttft.append(seconds)

    def recent_ttft_p99(self) -> float:
        """Nearest-rank p99 (a value some request really saw) of the recent window."""
        with self._recent_lock:
            recent = sorted(self._recent_ttft)
        return recent[math.ceil(0.99 * len(recent)) - 1] if recent else math.nan

    def inter_token(self, seconds: float, tokens: int) -> None:
        for _ in range(max(tokens, 1)):
            self.itl.observe(seconds / max(tokens, 1))

    def generated(self, tokens: int) -> None:
        self.generation_tokens.inc(tokens)

    def request_finished(self, e2e: Optional[float], prompt_tokens: int, cached_tokens: int, reason: str) -> None:
        if e2e is not None:
            self.e2e.observe(e2e)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.requests.labels(finish_reason=reason).inc()

    def rollout_finished(self, makespan: float, num_requests: int) -> None:
        self.rollout_makespan.set(makespan)
        self.rollout_makespan_hist.observe(makespan)
        self.rollout_requests.set(num_requests)
        self.rollouts_finished.inc()

    # --- engine thread ----------------------------------------------------------------------
    def set_engine_stats(self, stats: dict) -> None:
        self.num_running.set(stats.get("num_running_reqs", 0))
        self.num_queue.set(stats.get("num_queue_reqs", 0))
        self.token_usage.set(stats.get("token_usage", 0.0))
        self.paused.set(1 if stats.get("paused") else 0)

    def record_steps(self, records: Iterable[StepRecord]) -> None:
        """Consumes the engine's per-step records (protocol/records.py)."""
        last = None
        for rec in records:
            last = rec
            self.steps.inc()
            if rec.decode_rows and not rec.prefill_tokens:
                self.decode_step.observe(rec.duration_s)
                if rec.p_beside:
                    self.decode_step_beside_p.observe(rec.duration_s)
            if rec.p_epoch is not None:
                self.p_epoch.observe(rec.p_epoch.wall_s)
                self.p_epoch_enqueue.observe(rec.p_epoch.enqueue_s)
                self.p_epoch_cpu.observe(rec.p_epoch.cpu_s)
            for w in rec.decode_wait_s:
                self.decode_wait.observe(w)
            for w in rec.turnstile_wait_s:
                self.turnstile_wait.observe(w)
            for s in rec.rendezvous_s:
                self.rendezvous.observe(s)
            if rec.turnstile_rounds:
                self.rounds.inc(rec.turnstile_rounds)
            if rec.graph:
                self.graph_steps.inc()
            if rec.jit_compiles:
                self.jit_compiles.inc(rec.jit_compiles)
            if rec.spec_verify:
                self.spec_verify.inc(rec.spec_verify)
                self.spec_proposed.inc(rec.spec_proposed)
                self.spec_accepted.inc(rec.spec_accepted)
        if last is not None:
            self.multiplexing.set(1 if last.multiplexing_active else 0)
            self.span.set(last.span or 0)
