"""The device on CUDA: P and D each own a stream, and a collective is issued at once, in the
caller's thread, on the caller's current stream (`StreamDevice`).

It has the interface of the CPU device model (device.py: `collective`, `pending`, `frontier`), so
the collectives, the turnstile and the watchdog drive either. Issuing in the caller's thread is
what lets a CUDA graph capture D's collectives, and what keeps the order the turnstile sets on the
host the order the GPU's streams see. NCCL kernels run asynchronously: a collective waiting for its
peers spins on the GPU, not in a host thread, so a stall shows as work that never drains and the
watchdog's verdict ends it.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch


class _Done:
    """A host-side completion that is already there: the op was enqueued (its kernels may run on)."""
    error = None

    @staticmethod
    def wait(timeout: float | None = None) -> bool:
        return True

    @staticmethod
    def query() -> bool:
        return True


class StreamDevice:
    def __init__(self, on_progress: Callable[[dict], None] | None = None,
                 on_enqueue: Callable[[dict], None] | None = None) -> None:
        self.on_progress, self.on_enqueue = on_progress, on_enqueue
        self._last: dict[str, torch.cuda.Event] = {}     # per lane: after its last collective
        self._lock = threading.Lock()
        self.last_collective: dict | None = None

    def collective(self, lane: str, fn: Callable[[], Any], name: str, group: tuple, deps=(),
                   meta: dict | None = None):
        meta = dict(meta or {}, name=name, stream=lane, collective=name, group=list(group))
        self.last_collective = meta
        if self.on_enqueue:
            self.on_enqueue(meta)
        fn()
        if not torch.cuda.is_current_stream_capturing():   # a graph replays it later: nothing to record now
            ev = torch.cuda.Event()
            ev.record()
            with self._lock:
                self._last[lane] = ev
        if self.on_progress:
            self.on_progress(meta)
        return _Done

    def pending(self, lane: str | None = None) -> int:
        """Lanes whose last collective has not completed on the GPU."""
        with self._lock:
            evs = list(self._last.items())
        return sum(0 if ev.query() else 1 for k, ev in evs if lane is None or k == lane)

    def frontier(self) -> dict:
        with self._lock:
            evs = dict(self._last)
        return {"pending": {k: not ev.query() for k, ev in evs.items()},
                "last_collective": (self.last_collective or {}).get("name")}

    def close(self) -> None:
        pass


def make_streams(device: torch.device, sm_partition: int = 0,
                 priority: str | None = None) -> dict[str, torch.cuda.Stream]:
    """P's and D's streams; `priority` ("d", EngineConfig.priority_stream) creates that
    phase's stream at the device's highest priority, so the block scheduler gives SMs that free up
    to its waiting kernels first. With `sm_partition` S both live in green contexts of the same S
    SMs (the split of the device's SM resource is deterministic), so P and D compete for one
    partition's residency: the device condition under which crossed orders stall (issue 8)."""
    if not sm_partition:
        # torch maps a priority below the device's range to its highest
        return {k: torch.cuda.Stream(device, priority=-100 if k == priority else 0) for k in ("p", "d")}
    if priority is not None:
        raise ValueError("priority_stream with sm_partition: a green context's streams have one priority")
    return {k: _green_stream(sm_partition, device) for k in ("p", "d")}


def _green_stream(sms: int, device: torch.device) -> torch.cuda.Stream:
    from torch.cuda.green_contexts import GreenContext
    ctx = GreenContext.create(sms, device.index)
    _GREEN.append(ctx)   # a green context must outlive its streams: the process's lifetime
    s = ctx.Stream()
    return torch.cuda.Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


_GREEN: list = []
