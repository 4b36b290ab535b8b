"""The device model: per-rank streams feeding a fixed number of execution slots.

CpuDevice stands in for a GPU on CPU: each stream is FIFO (an op starts only after the
previous op of its stream completed and its cross-stream dependencies fired), and at most
`slots` ops execute at once, one per slot thread. slots=1 stands for full SM residency: a
collective waiting for its peers holds the only slot, which is what lets crossed orders
stall (docs/DISTRIBUTED.md). Collectives are real gloo calls on per-path process groups, so a
stall is a real one. On CUDA, streams.py's StreamDevice has the same interface.
"""
from __future__ import annotations

import itertools
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable


class DeviceError(RuntimeError):
    """An op failed on the device; the device refuses further work."""


class Event:
    """Completion of one op (like a CUDA event recorded right after it)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.t_enqueue = time.monotonic()
        self.t_start: float | None = None
        self.t_end: float | None = None

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        ok = self._done.wait(timeout)
        if ok and self.error is not None:
            raise DeviceError(f"op {self.name} failed: {self.error!r}") from self.error
        return ok


@dataclass
class Stream:
    name: str
    queue: deque = field(default_factory=deque)
    busy: bool = False
    enqueued: int = 0
    completed: int = 0
    last: Event | None = None


@dataclass
class _Op:
    seq: int
    stream: Stream
    fn: Callable[[], Any]
    event: Event
    deps: tuple[Event, ...]
    meta: dict


class CpuDevice:
    def __init__(self, slots: int = 1, dispatch: str = "fifo", seed: int = 0,
                 on_progress: Callable[[dict], None] | None = None,
                 on_enqueue: Callable[[dict], None] | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if dispatch not in ("fifo", "random"):
            raise ValueError(f"dispatch must be fifo|random, got {dispatch!r}")
        self.slots, self.dispatch = slots, dispatch
        self._rng = random.Random(seed)
        self._cv = threading.Condition()
        self._streams: dict[str, Stream] = {}
        self._seq = itertools.count()
        self._running: dict[int, str] = {}
        self._closed = False
        self.failed: BaseException | None = None
        self.last_collective: dict | None = None
        self.on_progress, self.on_enqueue = on_progress, on_enqueue
        self._threads = [threading.Thread(target=self._slot, args=(i,), name=f"slot{i}", daemon=True)
                         for i in range(slots)]
        for t in self._threads:
            t.start()

    # ---- enqueue side ----------------------------------------------------------------
    def stream(self, name: str) -> Stream:
        with self._cv:
            return self._streams.setdefault(name, Stream(name))

    def enqueue(self, stream: Stream | str, fn: Callable[[], Any], name: str,
                deps: Iterable[Event] = (), meta: dict | None = None) -> Event:
        s = self.stream(stream) if isinstance(stream, str) else stream
        meta = dict(meta or {}, name=name, stream=s.name)
        with self._cv:
            if self.failed is not None:
                raise DeviceError(f"device failed earlier: {self.failed!r}")
            if self._closed:
                raise DeviceError("device closed")
            op = _Op(next(self._seq), s, fn, Event(name), tuple(d for d in deps if d is not None), meta)
            s.queue.append(op)
            s.enqueued += 1
            s.last = op.event
            if meta.get("collective"):
                self.last_collective = meta
            self._cv.notify_all()
        if self.on_enqueue:
            self.on_enqueue(meta)
        return op.event

    def compute(self, stream: Stream | str, seconds: float, name: str = "compute",
                deps: Iterable[Event] = (), meta: dict | None = None) -> Event:
        return self.enqueue(stream, lambda: time.sleep(seconds), name, deps, meta)

    def collective(self, stream: Stream | str, fn: Callable[[], Any], name: str, group: tuple,
                   deps: Iterable[Event] = (), meta: dict | None = None) -> Event:
        """Enqueue a collective; `fn` makes the blocking call on the path's own process group."""
        return self.enqueue(stream, fn, name, deps, dict(meta or {}, collective=name, group=list(group)))

    # ---- execution side --------------------------------------------------------------
    def _pick(self) -> _Op | None:
        ready = [s.queue[0] for s in self._streams.values()
                 if s.queue and not s.busy and all(d.query() for d in s.queue[0].deps)]
        if not ready:
            return None
        if self.dispatch == "fifo":
            return min(ready, key=lambda o: o.seq)
        return self._rng.choice(ready)

    def _slot(self, idx: int) -> None:
        while True:
            with self._cv:
                op = None
                while not self._closed and self.failed is None and (op := self._pick()) is None:
                    self._cv.wait(0.05)
                if op is None:
                    return
                op.stream.queue.popleft()
                op.stream.busy = True
                self._running[idx] = op.event.name
                op.event.t_start = time.monotonic()
            try:
                op.fn()
            except BaseException as e:  # the op's failure is the device's failure
                op.event.error = e
                with self._cv:
                    self.failed = e
            op.event.t_end = time.monotonic()
            with self._cv:
                op.stream.busy = False
                op.stream.completed += 1
                self._running.pop(idx, None)
                op.event._done.set()
                self._cv.notify_all()
            if self.on_progress:
                self.on_progress(op.meta)

    # ---- queries -----------------------------------------------------------------------
    def pending(self, stream: Stream | str | None = None) -> int:
        """Ops enqueued but not complete (on one stream or all)."""
        with self._cv:
            if stream is None:
                ss = list(self._streams.values())
            elif isinstance(stream, str):
                ss = [self._streams[stream]] if stream in self._streams else []
            else:
                ss = [stream]
            return sum(s.enqueued - s.completed for s in ss)

    def synchronize(self, stream: Stream | str | None = None, timeout: float | None = None,
                    check: Callable[[], None] | None = None, poll_s: float = 0.05) -> None:
        """Wait for completion; `check` (e.g. the watchdog) is polled so a stall raises, not hangs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if check:
                check()  # first: a peer's exit after a stall also fails our collectives
            with self._cv:
                if self.failed is not None:
                    raise DeviceError(f"device failed: {self.failed!r}")
            if self.pending(stream) == 0:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"device not idle after {timeout}s: {self.frontier()}")
            with self._cv:
                self._cv.wait(poll_s)

    def frontier(self) -> dict:
        with self._cv:
            return {"running": sorted(self._running.values()),
                    "queued": {n: [o.event.name for o in list(s.queue)[:3]] for n, s in self._streams.items() if s.queue},
                    "last_collective": (self.last_collective or {}).get("name")}

    def close(self) -> None:
        """Stop idle slot threads; a slot blocked in a collective stays (daemon) until exit."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=0.2)
