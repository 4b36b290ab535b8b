"""The turnstile: a pure state machine for one rank's P epochs and D rounds (docs/DISTRIBUTED.md).

No I/O, no threads, no clocks: the controller (controller.py) drives it under a lock and the
rendezvous (rendezvous.py) makes all ranks agree on each round. Vocabulary from the paper:

* epoch e   – one P execution; epochs strictly increase.
* boundary i – a safe point where P has not yet issued its next registered collective;
               published in strictly increasing order, never past the permit.
* reached r  – highest boundary published in the current epoch (-1 before the first).
* permit p   – P may pass boundary i iff i < p; at i == p it stops and a round runs.
* span K     – permit increment per round (p <- p + K); UNBOUNDED lets P run to its end.
* round      – pre-D rendezvous -> D enqueued -> post-D ACK (orders enqueue, not completion).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

UNBOUNDED = 1 << 62  # a span that lets P run to the end of its epoch (global-* orderings)
END = -1             # boundary tag of a round held after the producer finished its epoch
NO_EPOCH = -1        # epoch tag of a round with no P epoch active (a D-only round)


class Ordering(str, Enum):
    NORMAL = "normal"                    # multiplexing off, strict P priority
    ISOLATION_ONLY = "isolation-only"    # separate communicators, no turnstile (can stall)
    GLOBAL_COMPLETE = "global-complete"  # D waits for P GPU completion of the whole epoch
    GLOBAL_ENQUEUE = "global-enqueue"    # D waits for the whole epoch's enqueue
    FINE_GRAINED = "fine-grained"        # the protocol: D between P segments of span K

    @property
    def multiplexes(self) -> bool:
        return self in (Ordering.GLOBAL_COMPLETE, Ordering.GLOBAL_ENQUEUE, Ordering.FINE_GRAINED)

    @property
    def registered_on_d_lane(self) -> bool:
        """Whether the registered P collective is routed behind D on the D lane (R- < G < R+)."""
        return self in (Ordering.GLOBAL_ENQUEUE, Ordering.FINE_GRAINED)


class Activation(str, Enum):
    ON = "on"
    OFF = "off"
    AUTO = "auto"


class ProducerState(str, Enum):
    IDLE = "idle"            # no epoch active
    RUNNING = "running"      # P between boundaries, below its permit
    AT_PERMIT = "at-permit"  # P stopped at boundary p, waiting for a round
    FINISHED = "finished"    # P issued its whole epoch; retired by the next round


class RoundState(str, Enum):
    NONE = "none"
    PRE_D = "pre-d"              # rendezvous 1 passed
    D_ENQUEUED = "d-enqueued"    # D launch returned, waiting for rendezvous 2


class TurnstileError(RuntimeError):
    """Base of every protocol violation; each names what was expected."""


class StaleEpochError(TurnstileError):
    """An event for an epoch older than the active (or last retired) one."""


class DuplicateEpochError(TurnstileError):
    """An epoch begun twice."""


class MissingProducerError(TurnstileError):
    """An event or round for an epoch/boundary no producer registered or reached."""


class NonMonotoneBoundaryError(TurnstileError):
    """A boundary published at or below the highest one already reached."""


class PermitExceededError(TurnstileError):
    """A boundary published past the permitted endpoint."""


class PhaseOrderError(TurnstileError):
    """A call out of the round order (e.g. ACK before pre-D, begin during a round)."""


class SpanError(TurnstileError):
    """A span that is not a positive integer."""


def check_span(span: int) -> int:
    if not isinstance(span, int) or isinstance(span, bool) or span < 1:
        raise SpanError(f"span must be a positive integer, got {span!r}")
    return span


@dataclass
class Turnstile:
    """One rank's turnstile. Methods raise a TurnstileError subclass and leave state unchanged."""

    span: int = 1
    epoch: int | None = None       # active epoch
    last_epoch: int = -1           # highest epoch ever begun
    reached: int = -1              # r
    permit: int = 0                # p
    producer: ProducerState = ProducerState.IDLE
    round: RoundState = RoundState.NONE
    rounds: int = 0
    round_tag: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        check_span(self.span)

    # ---- producer side (P) -------------------------------------------------------------
    def begin(self, epoch: int, d_enqueued: bool = False) -> int:
        """Register the producer of a new epoch. p=0 orders a ready D before P enters;
        if a D is already enqueued for this step, P may start at p=K. Returns p."""
        if not isinstance(epoch, int) or epoch < 0:
            raise MissingProducerError(f"begin(epoch={epoch!r}): epochs are integers >= 0")
        if epoch < self.last_epoch:
            raise StaleEpochError(f"begin(epoch={epoch}): stale, epoch {self.last_epoch} already began")
        if epoch == self.last_epoch:
            raise DuplicateEpochError(f"begin(epoch={epoch}): epoch already began")
        if self.producer is not ProducerState.IDLE:
            raise PhaseOrderError(
                f"begin(epoch={epoch}): epoch {self.epoch} still {self.producer.value}; "
                "it must be retired by a round or cancelled first")
        if self.round is not RoundState.NONE:
            raise PhaseOrderError(f"begin(epoch={epoch}) during a round ({self.round.value})")
        self.epoch, self.last_epoch = epoch, epoch
        self.reached = -1
        self.permit = self.span if d_enqueued else 0
        self.producer = ProducerState.RUNNING
        return self.permit

    def _active(self, epoch: int, what: str) -> None:
        if self.epoch is None or epoch > self.epoch:
            if epoch <= self.last_epoch:
                raise StaleEpochError(f"{what}(epoch={epoch}): epoch already retired")
            raise MissingProducerError(f"{what}(epoch={epoch}): no producer registered for this epoch")
        if epoch < self.epoch:
            raise StaleEpochError(f"{what}(epoch={epoch}): stale, active epoch is {self.epoch}")

    def publish(self, epoch: int, boundary: int) -> bool:
        """P reached `boundary`. Returns True if it may pass (boundary < p), False if it must stop."""
        self._active(epoch, "publish")
        if self.producer is not ProducerState.RUNNING:
            raise PhaseOrderError(
                f"publish(epoch={epoch}, boundary={boundary}): producer is {self.producer.value}")
        if boundary <= self.reached:
            raise NonMonotoneBoundaryError(
                f"publish(epoch={epoch}, boundary={boundary}): boundaries must increase, "
                f"already reached {self.reached}")
        if boundary > self.permit:
            raise PermitExceededError(
                f"publish(epoch={epoch}, boundary={boundary}): past the permitted endpoint {self.permit}")
        self.reached = boundary
        if boundary == self.permit:
            self.producer = ProducerState.AT_PERMIT
            return False
        return True

    def may_pass(self, epoch: int, boundary: int) -> bool:
        """Whether P, having published `boundary`, may now issue what follows it."""
        self._active(epoch, "may_pass")
        return boundary < self.permit

    def finish(self, epoch: int) -> None:
        """P issued the rest of its epoch; the next round retires it."""
        self._active(epoch, "finish")
        if self.producer is not ProducerState.RUNNING:
            raise PhaseOrderError(f"finish(epoch={epoch}): producer is {self.producer.value}")
        self.producer = ProducerState.FINISHED

    def cancel(self, epoch: int) -> None:
        """Drop the active epoch (request aborted); its submitted work drains elsewhere."""
        self._active(epoch, "cancel")
        if self.round is not RoundState.NONE:
            raise PhaseOrderError(f"cancel(epoch={epoch}) during a round ({self.round.value})")
        self._retire()

    # ---- consumer side (D rounds) ------------------------------------------------------
    def tag(self) -> tuple[int, int] | None:
        """The (epoch, boundary) a round would carry now, or None while P runs (wait for it)."""
        if self.producer is ProducerState.IDLE:
            return (NO_EPOCH, END)
        if self.producer is ProducerState.FINISHED:
            return (self.epoch, END)
        if self.producer is ProducerState.AT_PERMIT:
            return (self.epoch, self.permit)
        return None

    def pre_d(self, epoch: int, boundary: int) -> None:
        """Rendezvous 1 passed for round (epoch, boundary)."""
        if self.round is not RoundState.NONE:
            raise PhaseOrderError(f"pre_d({epoch}, {boundary}): round already {self.round.value}")
        now = self.tag()
        if now is None:
            raise MissingProducerError(
                f"pre_d(epoch={epoch}, boundary={boundary}): producer of epoch {self.epoch} is running "
                f"below its permit {self.permit} and has not reached it")
        if (epoch, boundary) != now:
            if epoch != NO_EPOCH and self.epoch is not None and epoch < self.epoch:
                raise StaleEpochError(f"pre_d(epoch={epoch}, boundary={boundary}): stale, state is {now}")
            raise MissingProducerError(
                f"pre_d(epoch={epoch}, boundary={boundary}): no producer there, state is {now}")
        self.round, self.round_tag = RoundState.PRE_D, now

    def enqueued(self) -> None:
        """This rank's D launch call returned."""
        if self.round is not RoundState.PRE_D:
            raise PhaseOrderError(f"enqueued(): round is {self.round.value}, expected pre-d")
        self.round = RoundState.D_ENQUEUED

    def ack(self, span: int | None = None) -> int:
        """Rendezvous 2 passed: p <- p + K (K = `span` or the current span). Returns p."""
        if self.round is RoundState.NONE:
            raise PhaseOrderError("ack(): no round in progress (pre_d first)")
        k = check_span(self.span if span is None else span)
        if self.producer is ProducerState.AT_PERMIT:
            self.permit = min(self.permit + k, UNBOUNDED)
            self.producer = ProducerState.RUNNING
        elif self.producer is ProducerState.FINISHED:
            self._retire()
        self.round, self.round_tag = RoundState.NONE, None
        self.rounds += 1
        return self.permit

    def set_span(self, span: int) -> None:
        """Takes effect at the next ACK."""
        self.span = check_span(span)

    def _retire(self) -> None:
        self.epoch, self.reached, self.permit = None, -1, 0
        self.producer = ProducerState.IDLE


def multiplexing(activation: Activation | str, p_active: bool, d_active: bool) -> bool:
    """Whether the turnstile runs. auto multiplexes only while P and D really coexist, so a
    decode-only stretch pays no rendezvous (the paper's 6.7 % decode-only loss)."""
    a = Activation(activation)
    if a is Activation.ON:
        return True
    if a is Activation.OFF:
        return False
    return p_active and d_active


def auto_span(d_occupancy: float, p_pressure: float, max_span: int = 4) -> int:
    """Span for `auto`. d_occupancy: decode rows / decode capacity in [0,1]; p_pressure: queued
    P tokens / prefill budget (>=0). Many D rows make every D wait costly -> short spans; a heavy
    P backlog with few D rows makes rendezvous overhead dominate -> long spans:
        K = 1 + round((max_span-1) * (1 - occupancy) * min(1, pressure)), clamped to [1, max_span].
    """
    occ = min(1.0, max(0.0, float(d_occupancy)))
    pressure = min(1.0, max(0.0, float(p_pressure)))
    return max(1, min(max_span, 1 + round((max_span - 1) * (1.0 - occ) * pressure)))
