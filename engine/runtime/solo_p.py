"""pd on the world of one, with `solo_overlap`: a P epoch on a thread (and, on CUDA, a stream) of its
own while the next steps' D goes on in the foreground — D replays its graph every step instead of
waiting out a fused eager P+D forward. The multi-rank engine does the same through the turnstile
(pd_step.py); one rank has no collectives to order, so nothing here but the thread and the epoch.

Rank 0's engine plans no P while an epoch is in flight (`p_busy`) and learns of its end from the
step report (`p_done`), exactly as on several ranks. P and D touch disjoint KV blocks, and each
phase has its own upload staging buffer (batch.py), so they share the worker safely.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from ..protocol.plan import Phase, StepPlan
from ..protocol.records import PEpoch


class SoloEpochs:
    def __init__(self, worker, config) -> None:
        self.w = worker
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="P")
        self.flight: tuple[StepPlan, Future] | None = None   # the plan whose P is running, and it
        self.finished: PEpoch | None = None   # the timing of the epoch the last run() finished
        if worker.cuda:
            from .streams import make_streams
            worker.streams = make_streams(worker.device, priority=config.priority_stream_on(multi=False))

    def _epoch(self, plan: StepPlan, planned: float):
        """On the P thread: the forward, then its stream drained, timed (PEpoch)."""
        w = self.w
        t0, c0 = time.monotonic(), time.thread_time()
        logits = w.forward(Phase.PREFILL, plan, "prefill", wait=False)
        t1, c1 = time.monotonic(), time.thread_time()
        if w.cuda:
            w.streams["p"].synchronize()
        tokens = sum(r.length for r in plan.replicas[w.replica].prefill)
        return logits, PEpoch(tokens, time.monotonic() - planned, t1 - t0, c1 - c0)

    def run(self, plan: StepPlan):
        """(D logits, P logits, D replayed a graph, the plan whose P the P logits are); P logits None
        while the epoch is still in flight."""
        w = self.w
        self.finished = None
        if self.flight is None:
            if plan.p_flight is not None:
                raise RuntimeError(f"step {plan.step}: the plan continues P epoch {plan.p_flight}, none is in flight")
            p = self._pool.submit(self._epoch, plan, time.monotonic())
            self.flight = (plan, p)
        elif plan.p_any or plan.p_flight != self.flight[0].step:
            raise RuntimeError(f"step {plan.step}: P epoch {self.flight[0].step} is in flight, the plan says "
                               f"p_flight={plan.p_flight} with{'' if plan.p_any else 'out'} P rows")
        d, graph = w.forward_d(plan) if plan.d_any else (None, False)
        started, p = self.flight
        if not plan.d_any:
            p.result()          # nothing else to run: wait for P (a drain, or D all finished)
        if not p.done():
            return d, None, graph, None
        self.flight = None
        logits, self.finished = p.result()
        return d, logits, graph, started
