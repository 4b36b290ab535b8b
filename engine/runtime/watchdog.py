"""Group watchdog: never a silent hang (docs/DISTRIBUTED.md, "Failure semantics").

Each rank publishes its frontier (epoch, boundary, phase, last enqueued collective, a progress
counter, whether it has outstanding work, a heartbeat) into a side store (a torch.distributed
TCPStore or FileStore: it keeps working while the gloo groups are deadlocked). Every rank reads
every frontier and reaches one of two verdicts, written to the store so every rank adopts the
first one said:

* stall: some rank has outstanding work and no rank's progress counter moved for `bound_s`,
  while every rank's heartbeat is fresh (live ranks waiting on each other);
* lost: some rank's heartbeat stopped for `lost_bound_s` (half the stall bound, at least 5 s: dead,
  stopped, or never started), the
  store itself is unreachable (node 0 is gone), or a launcher reported a rank's death.

`check()` then raises StallError or PeerLostError, and if the owning thread is itself stuck in a
collective, `on_exit` ends the process after `grace_s`. `verdict(exc)` gives the exit code, the
store's record first: a stall makes ranks exit, and the closed connections their peers then see
must not turn it into a lost peer.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable

from ..protocol.exits import EXIT_PEER_LOST, PeerLostError, exit_code, say


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


def report_lost(store: Any, rank: int, report: str, code: int = EXIT_PEER_LOST) -> None:
    """Tell every rank's watchdog that the group lost a peer (best effort: the store may be gone
    too), unless a stall was declared first. `code`: the exit code of the failure's cause (a rank's
    own error, e.g. a full disk, is 1); the first report wins, so every rank exits with its code."""
    try:
        if not store.check(["stall"]):
            store.compare_set("lost", "", json.dumps({"report": report, "by": rank, "code": code}))
    except Exception:
        pass


LOST_FLOOR_S = 5.0


class Watchdog:
    STORE_FAILURES = 3        # consecutive store errors before node 0 counts as gone

    def __init__(self, store: Any, rank: int, world: int, bound_s: float, poll_s: float = 0.1,
                 extra: Callable[[], dict] | None = None,
                 on_exit: Callable[[BaseException], None] | None = None, grace_s: float = 1.0,
                 on_declare: Callable[[StallError], None] | None = None,
                 lost_bound_s: float | None = None, join_bound_s: float = 300.0) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.bound_s, self.poll_s, self.grace_s = bound_s, poll_s, grace_s
        # Heartbeats come every poll; half the stall bound of silence is a dead or stopped rank, with
        # a floor so a loaded machine's scheduling gaps never read as a loss.
        self.lost_bound_s = max(bound_s / 2, LOST_FLOOR_S) if lost_bound_s is None else lost_bound_s
        # A rank that never published yet is still starting (its group joined; its watchdog comes up
        # once its process gets there): it has the join bound, not the heartbeat bound.
        self.join_bound_s = max(join_bound_s, self.lost_bound_s)
        # a heartbeat older than this is not "fresh": such a rank is on its way to lost, not stalled
        self.fresh_s = min(self.lost_bound_s, max(2.0, 20 * poll_s))
        self.extra, self.on_exit, self.on_declare = extra, on_exit, on_declare
        self._lock = threading.Lock()
        self._frontier: dict = {"epoch": None, "boundary": None, "phase": "init",
                                "last_collective": None, "progress": 0, "busy": False, "beat": 0}
        self._stop = threading.Event()
        self.stall: StallError | None = None
        self.lost: PeerLostError | None = None
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
        if self.lost is not None:
            raise self.lost

    @property
    def failure(self) -> BaseException | None:
        return self.stall or self.lost

    def declare_lost(self, report: str) -> None:
        """A peer is gone (e.g. a launcher saw a rank exit): tell every rank, unless a stall was said first."""
        report_lost(self.store, self.rank, report)
        self._adopt_lost(report)

    def verdict(self, exc: BaseException | None = None) -> int:
        """The exit code for this rank (exits.py), the group's record first."""
        stall, lost, cause = self.stall is not None, self.lost is not None, None
        try:
            stall = stall or self.store.check(["stall"])
            if self.store.check(["lost"]):
                lost, cause = True, json.loads(self.store.get("lost")).get("code")
        except Exception:
            lost = lost or self.stall is None   # node 0 (the store) is gone
        if not stall and isinstance(cause, int) and not isinstance(getattr(exc, "exit_code", None), int):
            return cause   # the first failure's code, on every rank: not "peer lost" for a peer's own error
        return exit_code(exc, stall=stall, lost=lost)

    def cause(self) -> str | None:
        """The group's failure report in the store (the first rank's, or a launcher's), if any."""
        try:
            for key in ("stall", "lost"):
                if self.store.check([key]):
                    return json.loads(self.store.get(key))["report"]
        except Exception:
            pass
        return None

    # ---- the watching thread -----------------------------------------------------------
    def start(self) -> "Watchdog":
        self._publish()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching; peers see this rank as left (not lost) from now on."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=2 * self.poll_s + 1)
        self.update(left=True)
        try:
            self._publish()
        except Exception:   # the store went first: nobody is left to tell
            pass

    def _publish(self) -> None:
        with self._lock:
            self._frontier["beat"] += 1
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
        beats: dict[int, tuple[int | None, float]] = {r: (None, since) for r in range(self.world)}
        failures = 0
        while not self._stop.wait(self.poll_s):
            if self.lost is not None:   # declared by another thread of this rank
                self._exit_after_grace(self.lost)
                return
            try:
                self._publish()
                fs = self.frontiers()
                said = {k: json.loads(self.store.get(k)) for k in ("stall", "lost") if self.store.check([k])}
                failures = 0
            except Exception as e:
                failures += 1
                if failures >= self.STORE_FAILURES:
                    self._adopt_lost(f"lost: the group's store (node 0) is unreachable: {e!r}")
                    self._exit_after_grace(self.lost)
                    return
                continue
            now = time.monotonic()
            if "stall" in said:   # a peer saw it first: adopt its report
                self._declare(said["stall"], fs, now - since)
                return
            if "lost" in said:
                self._adopt_lost(said["lost"]["report"])
                self._exit_after_grace(self.lost)
                return
            for r in range(self.world):
                beat = fs.get(r, {}).get("beat")
                if beat != beats[r][0]:
                    beats[r] = (beat, now)
            silent = {r: now - t for r, (_, t) in beats.items() if r != self.rank and not fs.get(r, {}).get("left")}
            gone = sorted(r for r, s in silent.items()
                          if s >= (self.lost_bound_s if r in fs else self.join_bound_s))
            if gone:
                why = "; ".join(f"rank {r}: " + (f"no heartbeat for {silent[r]:.1f}s (bound {self.lost_bound_s}s)"
                                                 if r in fs else f"never started in {silent[r]:.1f}s")
                                for r in gone)
                report = f"lost: {why}; frontiers:\n{format_frontiers(fs)}"
                self.declare_lost(report)
                self._exit_after_grace(self.lost)
                return
            sig = tuple(fs.get(r, {}).get("progress") for r in range(self.world))
            if sig != last_sig or not any(f.get("busy") for f in fs.values()):
                last_sig, since = sig, now
                continue
            if any(s >= self.fresh_s for r, s in silent.items() if r in fs):
                continue   # a rank is not answering: that is a loss in the making, not a stall
            if len(fs) < self.world:
                continue   # a rank is still starting (the join bound covers it): waiting on it is no stall
            waited = now - since
            if waited >= self.bound_s and self.stall is None:
                report = (f"stall: no rank made progress for {waited:.2f}s (bound {self.bound_s}s) "
                          f"while work was outstanding; frontiers:\n{format_frontiers(fs)}")
                self.store.set("stall", json.dumps({"report": report, "by": self.rank}))
                self._declare({"report": report, "by": self.rank}, fs, waited)
                return

    def _declare(self, stall: dict, fs: dict[int, dict], waited: float) -> None:
        err = StallError(stall["report"], fs, waited)
        say(f"[watchdog rank {self.rank}] {stall['report']}")
        if self.on_declare is not None:   # before check() raises: every thread is still where it stalled
            self.on_declare(err)
        self.stall = err
        self._exit_after_grace(err)

    def _adopt_lost(self, report: str) -> None:
        if self.lost is not None or self.stall is not None:
            return
        say(f"[watchdog rank {self.rank}] {report}")
        self.lost = PeerLostError(report)

    def _exit_after_grace(self, err: BaseException | None) -> None:
        if err is not None and self.on_exit is not None and not self._stop.wait(self.grace_s):
            self.on_exit(err)
