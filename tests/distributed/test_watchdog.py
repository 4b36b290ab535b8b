"""The watchdog's stall declaration in one process over a real store: the report names every
rank's frontier, the declare hook runs at once (a peer may kill this process within the grace),
the exit hook only after the grace, and progress keeps a busy rank from being declared, nor
does a peer that has not started yet."""
from __future__ import annotations

import threading
import time

import torch.distributed as dist

from pdrollout.engine.runtime.watchdog import StallError, Watchdog


def _watch(store, rank, **kw):
    calls: list[tuple[str, float]] = []
    done = threading.Event()
    wd = Watchdog(store, rank, 2, bound_s=0.3, poll_s=0.02, grace_s=0.4,
                  on_declare=lambda e: calls.append(("declare", time.monotonic())),
                  on_exit=lambda e: (calls.append(("exit", time.monotonic())), done.set()), **kw)
    return wd, calls, done


def test_declare_hook_runs_before_the_grace_and_exit_after_it():
    store = dist.HashStore()
    wd0, calls0, done0 = _watch(store, 0)
    wd1, calls1, done1 = _watch(store, 1)
    wd0.update(busy=True, phase="D", last_collective="D:1:0:dp-allgather")
    wd1.update(busy=True, phase="P", last_collective="P:1:0:attn-allreduce")
    wd0.start(), wd1.start()
    try:
        assert done0.wait(5) and done1.wait(5)
        for calls, wd in ((calls0, wd0), (calls1, wd1)):
            assert [c[0] for c in calls] == ["declare", "exit"]
            assert calls[1][1] - calls[0][1] >= 0.35          # the exit waited for the grace
            assert isinstance(wd.stall, StallError)
            assert "rank 0: " in str(wd.stall) and "dp-allgather" in str(wd.stall)
            assert "rank 1: " in str(wd.stall) and "attn-allreduce" in str(wd.stall)
    finally:
        wd0.stop(), wd1.stop()


def test_progress_is_not_a_stall():
    store = dist.HashStore()
    wd0, calls0, _ = _watch(store, 0)
    wd1, calls1, _ = _watch(store, 1)
    wd0.update(busy=True), wd1.update(busy=True)
    wd0.start(), wd1.start()
    try:
        t = time.monotonic()
        while time.monotonic() - t < 1.2:        # four bounds, with progress every 50 ms
            wd0.progress()
            time.sleep(0.05)
        assert calls0 == [] and calls1 == [] and wd0.stall is None
        wd0.check()
    finally:
        wd0.stop(), wd1.stop()


def test_a_rank_still_starting_is_not_a_stall():
    """Ranks waiting on a peer whose watchdog has not come up yet (a loaded machine's slow start)
    are not stalled: once it publishes, the same wait is."""
    store = dist.HashStore()
    wd0, calls0, done0 = _watch(store, 0)
    wd0.update(busy=True, phase="D")
    wd0.start()
    try:
        time.sleep(1.2)                          # four bounds with rank 1 not yet started
        assert calls0 == [] and wd0.stall is None
        wd1, calls1, done1 = _watch(store, 1)
        wd1.update(busy=True, phase="D")
        wd1.start()
        assert done0.wait(5) and isinstance(wd0.stall, StallError)
        wd1.stop()
    finally:
        wd0.stop()
