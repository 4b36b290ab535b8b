"""Small device-to-host reads (routing counts, valid-row counts) that never wait inside the driver.

`tensor.tolist()` on a CUDA tensor is a blocking copy into pageable memory: the calling thread
stays inside the CUDA driver until its stream reaches the copy, which under a crossed order can be
never. Issue 8's stalls were first suspected here; native stacks then showed the blocking calls
were first uses in the driver (see `Worker._warm_kernels`). A read here still keeps a waiting
thread out of the driver: a non-blocking copy into a pinned buffer allocated up front (pinned
allocation is itself a driver call), then an event polled with short sleeps, so the thread's
Python stack shows where it waits and nothing of the driver is held meanwhile.

One buffer per key (a phase); reads of one key must not overlap (each phase reads from one thread
at a time: its lane or its forward, which wait for each other).
"""
from __future__ import annotations

import threading
import time
from typing import Iterable

import torch

_POLL_S = 20e-6


class HostReader:
    def __init__(self, device: torch.device, keys: Iterable[str] = ("prefill", "decode"), size: int = 4096) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.size = size
        # Pinned allocation is itself a driver call that may wait: done here, before P and D overlap.
        self._buf = {k: torch.empty(size, dtype=torch.int64, pin_memory=True) for k in keys} if self.cuda else {}
        self._busy = {k: threading.Lock() for k in keys}
        self.reads = dict.fromkeys(keys, 0)   # per key: how often a path waited for the device (tests read it)

    def read(self, key: str, t: torch.Tensor) -> list[int]:
        """The integer values of `t` (flattened) on the host, after the current stream's prior work."""
        self.reads[key] = self.reads.get(key, 0) + 1
        if t.device.type != "cuda":
            return t.reshape(-1).tolist()
        n = t.numel()
        if n > self.size:
            raise ValueError(f"host read of {n} values > the {self.size}-value buffer of {key!r}")
        lock = self._busy[key]
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"overlapping host reads of {key!r}")
        try:
            buf = self._buf[key][:n]
            buf.copy_(t.reshape(-1), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            while not ev.query():
                time.sleep(_POLL_S)
            return buf.tolist()
        finally:
            lock.release()
