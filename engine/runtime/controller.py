"""Per-rank turnstile controller: the pure Turnstile driven by two threads and a Rendezvous.

The producer (P thread: the model's P segment) calls `boundary(epoch, i)` at every safe
boundary (for MoE: after expert notification, before routed data movement) and blocks there
while i == p. The foreground (the planner's step loop) calls `round(...)` once per D
iteration: it waits for P to stop at its permit (or finish), runs rendezvous 1, calls the
caller's `enqueue_d` (the D graph launch), runs rendezvous 2 (the ACK, which orders enqueue,
not completion), and grants p <- p + K. How long each wait is, per ordering:

  fine-grained     P stops every K boundaries; the registered P collective goes on the D lane
  global-enqueue   P stops only at boundary 0; next round waits for the whole epoch's enqueue
  global-complete  as global-enqueue, plus the round waits until P's device work completed
  normal / off     no multiplexing: P never stops; a round waits for P to finish and drain
  isolation-only   no turnstile at all (a diagnostic that can stall)
Every wait polls the watchdog, so a stall raises StallError instead of hanging.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from .rendezvous import Rendezvous
from ..protocol.turnstile import END, NO_EPOCH, UNBOUNDED, Activation, Ordering, ProducerState, Turnstile, auto_span, check_span, multiplexing


@dataclass
class RoundResult:
    epoch: int
    boundary: int
    d_any: bool               # a D iteration was enqueued on every rank this round
    rendezvous: bool          # False when the round needed no cross-rank agreement
    permit: int
    span: int
    d_wait_s: float           # round called -> D enqueued (the paper's D wait)
    rendezvous_s: float       # both rendezvous together
    p_incomplete_at_ack: bool  # P had submitted device work still running at the ACK
    # timing of the round on this rank (step logs; the rendezvous simulator's skew and D times)
    t_start: float = 0.0      # time.monotonic() when the round was called
    p_wait_s: float = 0.0     # called -> P stopped at its permit (pre-D entered)
    pre_s: float = 0.0        # pre-D rendezvous
    enq_s: float = 0.0        # D enqueue (the launch; eager D waits for its kernels)
    post_s: float = 0.0       # post-D rendezvous (ACK)


class TurnstileController:
    def __init__(self, rendezvous: Rendezvous | None, ordering: Ordering | str = Ordering.FINE_GRAINED,
                 span: int | str = 1, activation: Activation | str = Activation.ON,
                 watchdog=None, p_pending: Callable[[], int] | None = None, poll_s: float = 0.02) -> None:
        self.rdv, self.watchdog, self.poll_s = rendezvous, watchdog, poll_s
        self.p_pending = p_pending or (lambda: 0)
        self.ordering = Ordering(ordering)
        self.activation = Activation(activation)
        self.span_setting: int | str = span if span == "auto" else check_span(span)
        self.ts = Turnstile(span=1 if span == "auto" else span)
        self._cv = threading.Condition()
        self.results: list[RoundResult] = []
        self.producer_wait_s = 0.0
        self.boundaries = 0   # boundaries P published: each asks the turnstile for its permit
        self._cancelled: set[int] = set()

    # ---- settings (apply at the next round / epoch) --------------------------------------
    def set_control(self, ordering: str | None = None, span: int | str | None = None,
                    activation: str | None = None) -> None:
        with self._cv:
            if ordering is not None:
                self.ordering = Ordering(ordering)
            if activation is not None:
                self.activation = Activation(activation)
            if span is not None:
                self.span_setting = span if span == "auto" else check_span(span)

    @property
    def registered_lane(self) -> str:
        """Lane of the registered P collective: 'd' puts it behind D (R- < G < R+), else 'p'."""
        return "d" if self._multiplexing_order().registered_on_d_lane else "p"

    def _multiplexing_order(self) -> Ordering:
        return Ordering.NORMAL if self.activation is Activation.OFF else self.ordering

    # ---- producer side (P thread) --------------------------------------------------------
    def boundary(self, epoch: int, i: int) -> None:
        """Publish boundary i of `epoch`; return once P may issue what follows it."""
        with self._cv:
            may = self.ts.publish(epoch, i)
            self.boundaries += 1
            if self.watchdog is not None:
                self.watchdog.progress(phase="P:boundary", epoch=epoch, boundary=i)
            if may:
                return
            self._cv.notify_all()
            t0 = time.monotonic()
            while not self._passable(epoch, i):
                self._cv.wait(self.poll_s)
                self._check()
            self.producer_wait_s += time.monotonic() - t0
        if epoch in self._cancelled:
            raise CancelledEpoch(epoch)

    def _passable(self, epoch: int, i: int) -> bool:
        if epoch in self._cancelled or self.ts.epoch != epoch:
            return True
        return self.ts.may_pass(epoch, i)

    def finish(self, epoch: int) -> None:
        with self._cv:
            self.ts.finish(epoch)
            self._note(phase="P:finished", epoch=epoch)
            self._cv.notify_all()

    def retire(self, epoch: int) -> None:
        """Close a finished epoch without a round (orderings with no turnstile: isolation-only)."""
        with self._cv:
            if self.ts.epoch == epoch and self.ts.producer is ProducerState.FINISHED:
                self.ts.cancel(epoch)

    def cancel(self, epoch: int) -> None:
        """Plan-driven (same step on every rank): drop the epoch; a waiting producer is released."""
        with self._cv:
            self.ts.cancel(epoch)
            self._cancelled.add(epoch)
            self._cv.notify_all()

    # ---- foreground (planner step loop) -------------------------------------------------
    def begin(self, epoch: int, d_active: bool = True, d_enqueued: bool = False) -> int:
        """Register P epoch `epoch` before its producer starts (a rank-shared plan decision).
        Returns the initial permit: 0 orders a ready D first, K if a D is already enqueued,
        UNBOUNDED when this epoch will not be multiplexed."""
        with self._cv:
            order = self._multiplexing_order()
            p = self.ts.begin(epoch, d_enqueued=d_enqueued)
            if not order.multiplexes or not multiplexing(self.activation, True, d_active):
                self.ts.permit = p = UNBOUNDED  # P runs to its end without stopping
            self._note(phase="begin", epoch=epoch, boundary=None)
            self._cv.notify_all()
            return p

    def round(self, d_ready: bool, enqueue_d: Callable[[bool], object], *, work: bool = True,
              d_occupancy: float = 1.0, p_pressure: float = 0.0) -> RoundResult:
        """One turnstile round. `enqueue_d(ready)` launches this rank's D iteration; it is called on
        every rank when any rank is ready (idle-shaped when `ready` is False). Without a
        rendezvous (see activation) `d_ready` must be the rank-shared plan's value."""
        t0 = time.monotonic()
        order = self._multiplexing_order()
        if order is Ordering.ISOLATION_ONLY:  # no turnstile: enqueue now, whatever P is doing
            if d_ready:
                enqueue_d(True)
            return self._done(NO_EPOCH, END, d_ready, False, t0, t0, 0.0, UNBOUNDED, 0)
        with self._cv:
            while (tag := self.ts.tag()) is None:
                self._cv.wait(self.poll_s)
                self._check()
        epoch, boundary = tag
        if boundary == END and epoch != NO_EPOCH and order in (Ordering.GLOBAL_COMPLETE, Ordering.NORMAL):
            while self.p_pending() > 0:  # a P completion fence: only these orderings pay it
                self._check()
                time.sleep(self.poll_s)
        k = self._span(d_occupancy, p_pressure)
        grant = k if order is Ordering.FINE_GRAINED else UNBOUNDED
        rendezvous = (self.rdv is not None and order.multiplexes
                      and multiplexing(self.activation, epoch != NO_EPOCH, True)
                      and not (self.activation is Activation.AUTO and boundary == END))
        pre_s = post_s = 0.0
        t_pre = time.monotonic()
        self._note(phase="D:pre-d", epoch=epoch, boundary=boundary)
        if rendezvous:
            a = self.rdv.pre_d(epoch, boundary, d_ready, work)
            d_any, pre_s = a.d_any, a.seconds
        else:
            d_any = d_ready
        with self._cv:
            self.ts.pre_d(epoch, boundary)
        t_d = time.monotonic()
        if d_any:
            enqueue_d(d_ready)
            with self._cv:
                self.ts.enqueued()
        t_enq = time.monotonic()
        self._note(phase="D:post-d", epoch=epoch, boundary=boundary)
        if rendezvous:
            post_s = self.rdv.post_d(epoch, boundary, enqueued=d_any, expect=d_any).seconds
        incomplete = self.p_pending() > 0
        with self._cv:
            permit = self.ts.ack(span=grant)
            self._cv.notify_all()
        r = self._done(epoch, boundary, d_any, rendezvous, t0, t_enq, pre_s + post_s, permit, k, incomplete)
        r.t_start, r.p_wait_s, r.pre_s, r.enq_s, r.post_s = t0, t_pre - t0, pre_s, t_enq - t_d, post_s
        return r

    def _span(self, d_occupancy: float, p_pressure: float) -> int:
        k = auto_span(d_occupancy, p_pressure) if self.span_setting == "auto" else int(self.span_setting)
        self.ts.set_span(k)
        return k

    def _done(self, epoch, boundary, d_any, rendezvous, t0, t_enq, rdv_s, permit, k,
              incomplete=False) -> RoundResult:
        r = RoundResult(epoch, boundary, d_any, rendezvous, permit, k,
                        (t_enq - t0) if d_any else 0.0, rdv_s, incomplete)
        self.results.append(r)
        if self.watchdog is not None:
            self.watchdog.progress(phase="D:acked", epoch=epoch, boundary=boundary)
        return r

    def _note(self, **fields) -> None:
        if self.watchdog is not None:
            self.watchdog.update(**fields)

    def _check(self) -> None:
        if self.watchdog is not None:
            self.watchdog.check()

    @property
    def active(self) -> bool:
        with self._cv:
            return self.ts.producer is not ProducerState.IDLE


class CancelledEpoch(Exception):
    """Raised in the producer when its epoch was cancelled while it waited at a boundary."""
