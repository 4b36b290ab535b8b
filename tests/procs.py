"""Process trees of real `pdrollout` subprocesses, read from /proc: who descends from whom, who is
still alive, and a `pdrollout serve` started in its own session (one process group per tree), so a
test can inject a fault into one rank and then check that nothing of the tree outlived it."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

from pdrollout.engine.server.cli import EXIT_WITH_PARENT

_FORKSERVER = "multiprocessing.forkserver"   # its command line, and that of every process forked from it
CHAOS_TABLE: list[dict] = []   # rows of tests/distributed/test_chaos.py, printed in the terminal summary
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
    """The rank processes a launcher started (the children of its forkserver), oldest first."""
    kids = children_map()
    servers = [p for p in kids.get(server_pid, []) if _FORKSERVER in cmdline(p)]
    return sorted(r for s in servers for r in kids.get(s, []))


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
                 prefix: list[str] | None = None, wait_ready: bool = True) -> None:
        self.log_path = log
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        # its own session (a test signals its group), yet it ends with this process however that ends
        # (SIGTERM from the kernel, server/cli.py): a killed test run left idle servers behind; not
        # through a prefix, whose process would be the server's parent
        parent = {} if prefix else {EXIT_WITH_PARENT: str(os.getpid())}
        self.proc = subprocess.Popen([*(prefix or []), *PDROLLOUT, "serve", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                     env={**os.environ, **parent, **(env or {})})
        threading.Thread(target=self._pump, daemon=True).start()
        if wait_ready and (not self._ready.wait(ready_timeout) or self.url is None):
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
        kill_all(in_group(self.pid))
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


TEST_TOKEN = "PDROLLOUT_TEST_TOKEN"


def environ_has(pid: int, entry: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry in f.read().split(b"\0")
    except OSError:
        return False


class Leftovers:
    """What a test started and left running. Two marks, both read when the test ends: a process
    descending from this (pytest's) process that was not there before the test, and any process
    whose environment carries the test's token (`PDROLLOUT_TEST_TOKEN`, set for the test's
    duration and inherited by everything it starts: also an orphan of a `start_new_session` tree
    whose leader died, which init adopted). `exempt`: pids higher-scoped fixtures started; they
    and their trees may outlive a test."""

    def __init__(self, exempt: set[int]) -> None:
        self.me, self.exempt = os.getpid(), exempt
        self.before = set(descendants(self.me))
        self.token = f"{self.me}-{time.monotonic_ns()}"
        os.environ[TEST_TOKEN] = self.token

    def _exempt(self, pid: int, parent: dict[int, int]) -> bool:
        while pid > 1:
            if pid in self.exempt or (pid in self.before and not _session_helper(pid, parent)):
                return True   # a fixture's tree; pytest's forkserver is older than the test, its ranks not
            pid = parent.get(pid, 0)
        return False

    def stop(self) -> list[int]:
        """Live processes the test left behind."""
        if os.environ.get(TEST_TOKEN) == self.token:
            del os.environ[TEST_TOKEN]
        parent = {c: p for p, cs in children_map().items() for c in cs}
        mine = set(descendants(self.me))
        entry = f"{TEST_TOKEN}={self.token}".encode()
        return [pid for pid in all_pids()
                if pid != self.me and alive(pid) and not self._exempt(pid, parent) and not _session_helper(pid, parent)
                and (pid in mine or environ_has(pid, entry))]


def _session_helper(pid: int, parent: dict[int, int]) -> bool:
    """multiprocessing's resource tracker or forkserver: started on first use, lives with pytest. Not
    the processes forked from the forkserver (tests/ranks.py's ranks), though they share its command
    line: a rank is checked like any other process."""
    cmd = cmdline(pid)
    if "multiprocessing.resource_tracker" in cmd:
        return True
    return _FORKSERVER in cmd and _FORKSERVER not in cmdline(parent.get(pid, 0))


def kill_all(pids) -> None:
    """SIGCONT then SIGKILL to each: a stopped process is killed too."""
    for p in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass


# ---- a multi-rank server with requests in flight (tests/distributed/test_chaos.py, test_hygiene.py)
BOUND_S = 6.0   # --watchdog-bound: a silent peer is lost after 5 s all the same; a loaded machine seldom stalls 6 s
ENGINE = {"block_size": 4, "num_blocks": 512, "mixed_chunk_tokens": 16,
          "control": {"prefill_budget_tokens": 16, "ordering": "fine-grained", "activation": "on", "span": 1}}


def serve_args(model, *extra: str) -> list[str]:
    return ["--model", str(model), "--host", "127.0.0.1", "--port", "0", "--mode", "pd", "--device", "cpu",
            "--nproc", "2", "--adp", "1", "--ep", "2", "--watchdog-bound", str(BOUND_S),
            "--drain-timeout", "5", "--engine-config", json.dumps(ENGINE), *extra]


def prompt(i: int, n: int) -> list[int]:
    return [(i * 37 + k * 11) % 500 + 2 for k in range(n)]


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)", text, re.M)
    return float(m.group(1)) if m else 0.0


class InFlight:
    """A long non-streaming request, a long streaming one and a feeder of short prefill-heavy ones;
    each records how it ended. `outcomes` after `join`: kind -> (how, detail)."""

    def __init__(self, url: str, timeout: float = 120.0) -> None:
        self.url, self.timeout = url, timeout
        self.outcomes: dict[str, tuple[str, str]] = {}
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._plain, self._stream, self._feed)]
        for t in self.threads:
            t.start()

    def _body(self, i: int, length: int, new: int, **kw) -> dict:
        return {"input_ids": prompt(i, length), "sampling_params": {"max_new_tokens": new, "temperature": 0,
                                                                     "ignore_eos": True}, **kw}

    def _plain(self) -> None:
        try:
            r = httpx.post(self.url + "/generate", json=self._body(1, 30, 2000), timeout=self.timeout)
            body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            fr = (body.get("meta_info") or {}).get("finish_reason") or {}
            self.outcomes["generate"] = (f"HTTP {r.status_code} finish {fr.get('type')}",
                                         fr.get("message") or json.dumps(body)[:300])
        except httpx.TimeoutException as e:
            self.outcomes["generate"] = ("hung", repr(e))
        except httpx.HTTPError as e:
            self.outcomes["generate"] = ("connection closed", repr(e))

    def _stream(self) -> None:
        last, chunks = None, 0
        try:
            with httpx.stream("POST", self.url + "/generate", json=self._body(2, 30, 2000, stream=True),
                              timeout=self.timeout) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        last, chunks = json.loads(line[6:]), chunks + 1
            fr = ((last or {}).get("meta_info") or {}).get("finish_reason") or {}
            self.outcomes["stream"] = (f"stream ended after {chunks} chunks, finish {fr.get('type')}",
                                       fr.get("message") or json.dumps(last)[:300])
        except httpx.TimeoutException as e:
            self.outcomes["stream"] = ("hung", repr(e))
        except httpx.HTTPError as e:
            self.outcomes["stream"] = (f"connection closed after {chunks} chunks", repr(e))

    def _feed(self) -> None:
        i = 10
        while not self.stop.is_set():
            try:
                r = httpx.post(self.url + "/generate", json=self._body(i, 40, 3), timeout=self.timeout)
                self.outcomes["feeder"] = (f"HTTP {r.status_code}", r.text[:200])
            except httpx.TimeoutException as e:
                self.outcomes["feeder"] = ("hung", repr(e))
                return
            except httpx.HTTPError as e:
                self.outcomes["feeder"] = ("connection closed", repr(e))
                return
            i += 1

    def join(self, timeout: float) -> list[str]:
        """Names of requests still open at the deadline (hung)."""
        self.stop.set()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [n for n, t in zip(("generate", "stream", "feeder"), self.threads) if t.is_alive()]


def mid_round(srv: Served, flight: InFlight) -> None:
    """Until tokens flow and the turnstile runs rounds (P epochs beside decoding rows)."""
    deadline = time.monotonic() + 120
    r0 = metric(srv.url, "pdrollout:turnstile_rounds_total")
    while time.monotonic() < deadline:
        if (metric(srv.url, "pdrollout:generation_tokens_total") >= 10
                and metric(srv.url, "pdrollout:turnstile_rounds_total") >= r0 + 5):
            return
        time.sleep(0.1)
    raise AssertionError(f"no turnstile rounds with tokens flowing; outcomes {flight.outcomes}\n{srv.tail()}")
