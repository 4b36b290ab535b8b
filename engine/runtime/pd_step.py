"""A pd step on several ranks: P on its own thread as epoch = step, stopping at each MoE layer's
safe boundary; D on the foreground through the turnstile's rounds (docs/DISTRIBUTED.md).

Under fine-grained ordering a P epoch spans steps: the step that starts it returns after its D
round, and the next steps (D only: rank 0 plans no P while an epoch is in flight) each run their D
in one round at P's next permitted boundary. The step whose round finds P finished hands back P's
logits with the plan that started the epoch; a step with no D row runs rounds until P finishes.

The ordering, span and activation are the plan's control, so a change lands at the same step on
every rank. One rank runs a pd step as one fused forward instead (worker.py): it has no
collective to order.
"""
from __future__ import annotations

import queue
import random
import threading
import time
import traceback

from ..protocol.plan import Phase, ReplicaWork, RowSpec, StepPlan
from ..protocol.turnstile import END, Ordering


class TurnstileStep:
    def __init__(self, worker) -> None:
        self.w = worker
        self._pq: "queue.Queue" = queue.Queue()
        self._p_done: "queue.Queue" = queue.Queue()
        self._skew = random.Random(worker.config.seed * 7919 + worker.rank)
        self.skew_applied: list[float] = []   # this step's injected delays (ms), for the step log
        # the crossed diagnostic's gates: set once this rank's P (or D) holds a collective
        self.gate = {"p": threading.Event(), "d": threading.Event()}
        self.flight: tuple[StepPlan, int, float] | None = None   # (plan, epoch, P pressure) in flight
        self.p_ready = False   # this rank's P of the epoch in flight is done (uncrossed.py)
        threading.Thread(target=self._producer, name="P", daemon=True).start()

    # ---- one step ----------------------------------------------------------------------
    def run(self, plan: StepPlan):
        """(D logits, P logits, D replayed a graph, the plan whose P the P logits are) of this rank's
        replica; P logits None while this step's epoch is still in flight (or there was no P)."""
        w = self.w
        out: dict = {}
        ctl = w.group.ctl
        order = ctl.ordering if w.control.activation != "off" else Ordering.NORMAL
        w.group.col.p_lane = ctl.registered_lane
        self.skew_applied = []

        def enqueue_d(ready: bool) -> None:
            self._enqueue_d(plan, out)

        occupancy = max((r.decode_rows for r in plan.replicas), default=0) / w.config.max_running
        if self.flight is not None:
            return self._continue(plan, enqueue_d, occupancy, out)
        if plan.p_flight is not None:
            raise RuntimeError(f"step {plan.step}: rank 0 continues P epoch {plan.p_flight}, none is in flight here")
        if not plan.p_any:
            if plan.d_any:
                ctl.round(True, enqueue_d, d_occupancy=occupancy)
            return self.d_done(out.get("d")), None, out.get("graph", False), None
        epoch = plan.step
        ctl.begin(epoch, d_active=plan.d_any)
        for g in self.gate.values():
            g.clear()
        # The crossed diagnostic: odd sides enqueue P before D, even ones D before P.
        d_first = w.opt.cross_isolation and order is Ordering.ISOLATION_ONLY and plan.d_any \
            and w.side(w.rank) % 2 == 0
        if not d_first:
            self._pq.put((plan, epoch))
        if order is Ordering.ISOLATION_ONLY:
            if w.opt.cross_isolation and not d_first and plan.d_any:
                self._wait(self.gate["p"])
            if d_first:   # release P once D holds a collective that needs the other side
                threading.Thread(target=lambda: (self._wait(self.gate["d"]), self._pq.put((plan, epoch))),
                                 daemon=True).start()
            if plan.d_any:
                ctl.round(True, enqueue_d)
            out["p"] = self.wait_p()
            ctl.retire(epoch)
            return self.d_done(out.get("d")), out["p"], out.get("graph", False), plan
        first = True
        pressure = sum(r.prefill_tokens for r in plan.replicas) / max(1, w.control.prefill_budget_tokens)
        # Rank-shared: the plan, and the control every rank took from it.
        spans = plan.p_span and plan.d_any and order is Ordering.FINE_GRAINED
        while True:
            r = ctl.round(first and plan.d_any, enqueue_d, d_occupancy=occupancy, p_pressure=pressure)
            first = False
            if r.epoch == epoch and r.boundary == END:
                break
            if spans:   # the epoch goes on under the next steps' D rounds
                self.flight = (plan, epoch, pressure)
                return self.d_done(out.get("d")), None, out.get("graph", False), None
        p = self.wait_p()
        return self.d_done(out.get("d")), p, out.get("graph", False), plan

    def _enqueue_d(self, plan: StepPlan, out: dict) -> None:
        w = self.w
        if w.opt.skew_ms:
            delay = self._skew.uniform(0, w.opt.skew_ms)
            self.skew_applied.append(delay)
            time.sleep(delay / 1e3)
        # the delayed ACK: return once D's kernels are enqueued (the ACK orders enqueue, not
        # completion), so P's next work can overlap D's tail; D is waited for before sampling.
        out["d"], out["graph"] = w.forward_d(plan, wait=not self.delayed_ack())

    def d_done(self, logits):
        """D's logits once its kernels completed (the delayed ACK returns before they do)."""
        end, self.w.d_end = self.w.d_end, None
        if end is not None:
            end.synchronize()
        return logits

    def delayed_ack(self) -> bool:
        """--d-async, by default on CUDA where the ordering puts P's registered collective behind D
        on D's stream: there a D still running cannot meet P's next R out of order (docs/DISTRIBUTED.md
        "Finding"); under global-complete, normal and activation off it can."""
        w = self.w
        if w.opt.d_async is not None:
            return w.opt.d_async
        return w.cuda and w.group.ctl.registered_lane == "d"

    def _continue(self, plan: StepPlan, enqueue_d, occupancy: float, out: dict):
        """A step while an epoch of an earlier step is in flight: its D in one round at P's next
        permitted boundary; without D, rounds until P finishes."""
        w, ctl = self.w, self.w.group.ctl
        started, epoch, pressure = self.flight
        if plan.p_any or plan.p_flight != epoch:
            raise RuntimeError(f"step {plan.step}: P epoch {epoch} is in flight, the plan says "
                               f"p_flight={plan.p_flight} with{'' if plan.p_any else 'out'} P rows")
        r = ctl.round(plan.d_any, enqueue_d, d_occupancy=occupancy, p_pressure=pressure)
        if plan.d_any and not (r.epoch == epoch and r.boundary == END):
            return self.d_done(out.get("d")), None, out.get("graph", False), None
        while not (r.epoch == epoch and r.boundary == END):
            r = ctl.round(False, enqueue_d, d_occupancy=occupancy, p_pressure=pressure)
        p = self.wait_p()
        self.flight = None
        return self.d_done(out.get("d")), p, out.get("graph", False), started

    def on_collective(self, phase: str, crosses: bool) -> None:
        """The device saw a collective enqueued: open the crossed diagnostic's gate for its side."""
        if phase == "P" or crosses:
            self.gate["p" if phase == "P" else "d"].set()

    # ---- the P thread ------------------------------------------------------------------
    def _producer(self) -> None:
        w = self.w
        while True:
            plan, epoch = self._pq.get()
            try:
                if epoch is None:   # the start-up warm-up: no turnstile
                    self._p_done.put(w.forward(Phase.PREFILL, plan, "prefill"))
                    continue

                def boundary(i: int) -> None:
                    w.group.ctl.boundary(epoch, i)
                logits = w.forward(Phase.PREFILL, plan, "prefill", boundary=boundary)
                w.group.ctl.finish(epoch)
                self._p_done.put(logits)
            except BaseException as e:   # fail fast: peers see the closed connections and stop too
                traceback.print_exc()
                w.exit_now(e)

    def _wait(self, ev: threading.Event) -> None:
        while not ev.wait(0.05):
            self.w.wd.check()

    def wait_p(self):
        while True:
            try:
                return self._p_done.get(timeout=0.05)
            except queue.Empty:
                self.w.wd.check()

    def warm_paths(self) -> None:
        """One tiny P forward (on the P thread), then one D forward (here), one after the other on
        every rank, before P and D can overlap: each path's first-use work (cuBLAS handles and
        workspaces for its thread and stream, allocator segments, kernel loading, NCCL on its
        stream) happens while no collective waits for peers; a first use behind the other path's
        spinning NCCL kernel blocks the host (issue 8). Both rows write only the null slot."""
        w = self.w
        row = lambda kind: RowSpec("warmup", kind, 0, (0,), (w.num_blocks,), samples=False)
        plan = StepPlan(step=-1, control={}, replicas=tuple(
            ReplicaWork(decode=(row(Phase.DECODE),), prefill=(row(Phase.PREFILL),)) for _ in range(w.topo.adp)))
        for lane in ("p", "d"):   # the registered P collectives on either stream
            w.group.col.p_lane = lane
            self._pq.put((plan, None))
            self.wait_p()
        w.forward(Phase.DECODE, plan, "decode")
