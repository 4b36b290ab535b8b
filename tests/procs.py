"""Process trees of real `pdrollout` subprocesses, read from /proc: who descends from whom, who is
still alive, and a `pdrollout serve` started in its own session (one process group per tree), so a
test can inject a fault into one rank and then check that nothing of the tree outlived it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

PDROLLOUT = [sys.executable, "-c", "import sys; from pdrollout.engine.cli import main; sys.exit(main())"]


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of a live or zombie process; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()   # the name may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[2])


def alive(pid: int) -> bool:
    """Running (or stopped): not gone and not a zombie waiting to be reaped."""
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for pid in all_pids():
        st = _stat(pid)
        if st is not None and st[0] != "Z":
            out.setdefault(st[1], []).append(pid)
    return out


def descendants(pid: int) -> list[int]:
    kids, out, todo = children_map(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def in_group(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (a tree started in its own session keeps it)."""
    return [p for p in all_pids() if (st := _stat(p)) is not None and st[0] != "Z" and st[2] == pgid]


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def rank_pids(server_pid: int) -> list[int]:
    """The rank processes a launcher spawned (multiprocessing's spawn children), oldest first."""
    return sorted(p for p in descendants(server_pid) if "spawn_main" in cmdline(p))


def wait_gone(pids, timeout: float) -> list[int]:
    """Waits until none of `pids` is alive; returns those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


class Served:
    """`pdrollout serve ARGS` in its own session, stdout and stderr in `log`; `url` once ready."""

    def __init__(self, args: list[str], log, env: dict | None = None, ready_timeout: float = 240.0,
                 prefix: list[str] | None = None) -> None:
        self.log_path = log
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        self.proc = subprocess.Popen([*(prefix or []), *PDROLLOUT, "serve", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._ready.wait(ready_timeout) or self.url is None:
            self.kill()
            raise RuntimeError(f"server did not become ready:\n{self.tail()}")

    def _pump(self) -> None:
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                self.lines.append(line)
                log.write(line)
                log.flush()
                if "ready on http://" in line:
                    self.url = line.split("ready on ")[1].strip()
                    self._ready.set()
        self._ready.set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, n: int = 6000) -> str:
        return "".join(self.lines)[-n:]

    def tree(self) -> list[int]:
        return [self.pid, *descendants(self.pid)]

    def kill(self) -> None:
        """Everything of the tree, stopped processes included (a test's cleanup, never its check)."""
        for p in in_group(self.pid):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
