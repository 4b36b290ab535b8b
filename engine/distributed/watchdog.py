"""Stall watchdog: never a silent hang (DESIGN §3).

Each rank publishes its frontier (epoch, boundary, phase, last enqueued collective, a progress
counter, whether it has outstanding work) into a side store (a torch.distributed TCPStore or
FileStore: it keeps working while the gloo groups are deadlocked). Every rank reads every
frontier; when some rank has outstanding work and no rank's counter moved for `bound_s`, the
run is stalled: `check()` raises StallError carrying every rank's frontier, and if the owning
thread is itself stuck in a collective, `on_stall_exit` ends the process after `grace_s`.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, Callable


class StallError(RuntimeError):
    """No rank made progress for the bound while work was outstanding."""

    def __init__(self, report: str, frontiers: dict[int, dict], waited_s: float) -> None:
        super().__init__(report)
        self.report, self.frontiers, self.waited_s = report, frontiers, waited_s


def format_frontiers(frontiers: dict[int, dict]) -> str:
    keys = ("epoch", "boundary", "phase", "last_collective", "progress", "busy", "device")
    lines = []
    for r in sorted(frontiers):
        f = frontiers[r]
        lines.append(f"  rank {r}: " + ", ".join(f"{k}={f.get(k)}" for k in keys if k in f))
    return "\n".join(lines)


class Watchdog:
    def __init__(self, store: Any, rank: int, world: int, bound_s: float, poll_s: float = 0.1,
                 extra: Callable[[], dict] | None = None,
                 on_stall_exit: Callable[[StallError], None] | None = None, grace_s: float = 1.0,
                 on_declare: Callable[[StallError], None] | None = None) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.bound_s, self.poll_s, self.grace_s = bound_s, poll_s, grace_s
        self.extra, self.on_stall_exit, self.on_declare = extra, on_stall_exit, on_declare
        self._lock = threading.Lock()
        self._frontier: dict = {"epoch": None, "boundary": None, "phase": "init",
                                "last_collective": None, "progress": 0, "busy": False}
        self._stop = threading.Event()
        self.stall: StallError | None = None
        self._thread: threading.Thread | None = None

    # ---- called by the controller / device ---------------------------------------------
    def progress(self, **fields: Any) -> None:
        with self._lock:
            self._frontier.update(fields)
            self._frontier["progress"] += 1

    def update(self, **fields: Any) -> None:
        with self._lock:
            self._frontier.update(fields)

    def check(self) -> None:
        if self.stall is not None:
            raise self.stall

    # ---- the watching thread -----------------------------------------------------------
    def start(self) -> "Watchdog":
        self._publish()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=2 * self.poll_s + 1)

    def _publish(self) -> None:
        with self._lock:
            f = dict(self._frontier)
        if self.extra:
            f["device"] = self.extra()
        self.store.set(f"frontier/{self.rank}", json.dumps(f, default=str))

    def frontiers(self) -> dict[int, dict]:
        out = {}
        for r in range(self.world):
            key = f"frontier/{r}"
            if self.store.check([key]):
                out[r] = json.loads(self.store.get(key))
        return out

    def _run(self) -> None:
        last_sig, since = None, time.monotonic()
        while not self._stop.wait(self.poll_s):
            try:
                self._publish()
                fs = self.frontiers()
            except Exception as e:  # store gone: the run is over
                print(f"[watchdog rank {self.rank}] store unavailable: {e!r}", file=sys.stderr)
                return
            sig = tuple(fs.get(r, {}).get("progress") for r in range(self.world))
            now = time.monotonic()
            if self.store.check(["stall"]):  # a peer saw it first: adopt its report
                self._declare(json.loads(self.store.get("stall")), fs, now - since)
                return
            if sig != last_sig or not any(f.get("busy") for f in fs.values()):
                last_sig, since = sig, now
                continue
            waited = now - since
            if waited >= self.bound_s and self.stall is None:
                report = (f"stall: no rank made progress for {waited:.2f}s (bound {self.bound_s}s) "
                          f"while work was outstanding; frontiers:\n{format_frontiers(fs)}")
                self.store.set("stall", json.dumps({"report": report, "by": self.rank}))
                self._declare({"report": report, "by": self.rank}, fs, waited)
                return

    def _declare(self, stall: dict, fs: dict[int, dict], waited: float) -> None:
        err = StallError(stall["report"], fs, waited)
        print(f"[watchdog rank {self.rank}] {stall['report']}", file=sys.stderr, flush=True)
        if self.on_declare is not None:   # before check() raises: every thread is still where it stalled
            self.on_declare(err)
        self.stall = err
        if self.on_stall_exit is not None and not self._stop.wait(self.grace_s):
            self.on_stall_exit(self.stall)
