"""A fresh `pdrollout serve` subprocess per benchmarked mode, on 127.0.0.1 and a free port."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from .measures import BenchError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pdrollout() -> list[str]:
    """The `pdrollout` console script of this interpreter, else the same entry point via -c."""
    exe = os.path.join(os.path.dirname(sys.executable), "pdrollout")
    if os.access(exe, os.X_OK):
        return [exe]
    found = shutil.which("pdrollout")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from pdrollout.engine.cli import main; sys.exit(main())"]


def parse_cpus(text: str) -> frozenset[int]:
    """A CPU list as taskset and cpusets write it ("0-7,16"): ValueError on a malformed one, or on
    CPUs this process may not run on (a server pinned there would fail at its first instruction)."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"cpus {text!r}: not a CPU list like 0-7,16") from None
        if first < 0 or last < first:
            raise ValueError(f"cpus {text!r}: range {part.strip()!r} is empty or negative")
        cpus.update(range(first, last + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ValueError(f"cpus {text!r}: {sorted(cpus - allowed)} not among this process's CPUs "
                         f"({min(allowed)}-{max(allowed)}, {len(allowed)} of them)")
    return frozenset(cpus)


def pinned(cmd: list[str], cpus: frozenset[int] | None) -> list[str]:
    """`cmd` run on `cpus` only: a trampoline sets its own affinity, then execs cmd, so the server,
    its threads and its ranks inherit it from their first instruction (no external taskset, and no
    preexec_fn in a process with threads)."""
    if cpus is None:
        return cmd
    trampoline = "import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')}); " \
                 "os.execvp(sys.argv[2], sys.argv[2:])"
    return [sys.executable, "-c", trampoline, ",".join(map(str, sorted(cpus))), *cmd]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: str, n: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


class Live:
    """A started server: its URL, and whether it has died (for the replay to fail fast)."""

    def __init__(self, url: str, proc: subprocess.Popen, log_path: str):
        self.url, self.proc, self.log_path = url, proc, log_path

    def died(self) -> str | None:
        if self.proc.poll() is None:
            return None
        return (f"the server exited with {self.proc.returncode} during the replay; "
                f"log {self.log_path}:\n{_tail(self.log_path)}")


@contextlib.contextmanager
def serve(model: str, mode: str, log_path: str, *, device: str | None = None,
          extra_args: tuple[str, ...] = (), startup_timeout_s: float = 600.0, env: dict | None = None,
          cpus: frozenset[int] | None = None):
    """Start the server, wait for GET /health 200, yield it (Live); SIGTERM and wait on exit.
    `env`: the server's environment (default: this process's), e.g. its CUDA_VISIBLE_DEVICES;
    `cpus`: the CPUs its whole process tree runs on (parse_cpus; None: wherever the OS puts it)."""
    port = free_port()
    # the bench is the server's only client: a stop (the bench done or interrupted) need not wait long
    drain = [] if "--drain-timeout" in extra_args else ["--drain-timeout", "2"]
    cmd = _pdrollout() + ["serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                          "--mode", mode, *(["--device", device] if device else []), *drain, *extra_args]
    url = f"http://127.0.0.1:{port}"
    # the server ends with this process, even one killed without running the `finally` below
    env = {**(os.environ if env is None else env), "PDROLLOUT_EXIT_WITH_PARENT": str(os.getpid())}
    with open(log_path, "ab") as log:
        # its own session: the whole tree (ranks included) can be ended by its process group
        proc = subprocess.Popen(pinned(cmd, cpus), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not _healthy(url):
            if proc.poll() is not None:
                raise BenchError(f"`{' '.join(cmd)}` exited with {proc.returncode} before it was "
                                 f"healthy; log {log_path}:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                raise BenchError(f"server for mode {mode} not healthy after {startup_timeout_s:.0f}"
                                 f" s; log {log_path}:\n{_tail(log_path)}")
            time.sleep(0.25)
        yield Live(url, proc, log_path)
    finally:
        stop_tree(proc, grace_s=30.0)


def stop_tree(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the server (it drains, stops its ranks and exits), then SIGKILL whatever is left of
    its process group after the grace."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)   # the leader's pid is the group's id
    proc.wait()
