"""The ranks of this node: their processes, forked from a forkserver that imported torch once,
how they ended, and a watch on the first to end (node.py's WorkerNode and launcher.py use them)."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

from ..protocol.layout import GroupLayout


@dataclass
class LocalRanks:
    """The processes this node started and how they ended."""
    layout: GroupLayout
    procs: dict[int, object] = field(default_factory=dict)     # global rank -> Process

    def codes(self) -> dict[int, int | None]:
        return {r: p.exitcode for r, p in self.procs.items()}

    def first_exit(self) -> tuple[int, int] | None:
        """(rank, code) of a rank that ended, if any."""
        for r, p in self.procs.items():
            if p.exitcode is not None:
                return r, p.exitcode
        return None

    def terminate(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after the grace: no rank outlives its launcher."""
        live = [p for p in self.procs.values() if p.is_alive()]
        for p in live:
            p.terminate()
        deadline = time.monotonic() + grace_s
        for p in live:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in live:
            if p.is_alive():
                p.kill()
                p.join(2)

    def wait_all(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))


# A launcher that is leaving (launcher.reap_children) starts no more ranks: node 0 may leave while its
# engine thread is still loading, and a rank started after the reaping would outlive it.
_spawning = threading.Lock()
_leaving = False


def stop_spawning() -> None:
    global _leaving
    with _spawning:
        _leaving = True


# Ranks fork from one server process per launcher (multiprocessing's forkserver, started with this
# process's first rank) that imported torch once: a spawned rank, a fresh interpreter, spent ~2 CPU-s
# on that import (docs/DISTRIBUTED.md). The server never touches CUDA, so each rank initializes its
# own, as under spawn.
PRELOAD = ["torch", "torch.distributed"]


def _enter(env: dict[str, str], target, args: tuple) -> None:
    """In the forked rank: its launcher's environment as it was at the start (the server's is that of
    when the server started; multiprocessing restores the directory and sys.path itself)."""
    # The server hands every child a copy of the launcher's end of the pipe by which it sees the
    # launcher alive: held by a rank, it kept the server (the rank's parent) up after the launcher
    # died, and the rank never saw itself orphaned (launcher.leave_with_launcher).
    from multiprocessing import forkserver
    fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        forkserver._forkserver._forkserver_alive_fd = None
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def start_process(target, args: tuple, name: str):
    """`target(*args)` in a rank process forked from the forkserver, started; a daemon, so it ends
    with its launcher's interpreter."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    p = ctx.Process(target=_enter, args=(dict(os.environ), target, args), name=name, daemon=True)
    p.start()
    return p


def spawn(layout: GroupLayout, ranks, target, args: tuple) -> LocalRanks:
    """Start `target(rank, *args)` for each rank in its own process (start_process)."""
    out = LocalRanks(layout)
    with _spawning:
        if _leaving:
            raise RuntimeError("this launcher is stopping: no rank starts now")
        for r in ranks:
            out.procs[r] = start_process(target, (r, *args), f"pdrollout-rank{r}")
    return out


def watch(local: LocalRanks, on_exit, poll_s: float = 0.2, stop: threading.Event | None = None) -> threading.Thread:
    """A thread that calls `on_exit(rank, code)` once, when the first of `local`'s ranks ends."""
    stop = stop or threading.Event()

    def run():
        while not stop.wait(poll_s):
            ended = local.first_exit()
            if ended is not None:
                on_exit(*ended)
                return
    t = threading.Thread(target=run, name="rank-watch", daemon=True)
    t.start()
    return t
