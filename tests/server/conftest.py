"""A real `pdrollout serve` subprocess on 127.0.0.1 (port 0: it prints the port it bound)."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

SERVE = [sys.executable, "-c", "import sys; from pdrollout.engine.cli import main; sys.exit(main())", "serve"]


class ServerProcess:
    def __init__(self, model, *extra: str, env: dict | None = None):
        self.lines: list[str] = []
        self._ready: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen(
            [*SERVE, "--model", str(model), "--host", "127.0.0.1", "--port", "0", "--log-level", "info", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        threading.Thread(target=self._pump, daemon=True).start()
        self.url = self._wait_ready(timeout=240)
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if "ready on http://" in line:
                self._ready.put(line.split("ready on ")[1].strip())
        self._ready.put(None)

    def _wait_ready(self, timeout):
        try:
            url = self._ready.get(timeout=timeout)
        except queue.Empty:
            url = None
        if url is None:
            self.proc.kill()
            raise RuntimeError("server did not become ready:\n" + "".join(self.lines[-50:]))
        return url

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def stats(self) -> dict:
        return self.http.get("/get_server_info").json()["internal_states"][0]

    def wait_for(self, pred, timeout=60, what="condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.stats()
            if pred(s):
                return s
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; last stats {s}")

    def stop(self, timeout=60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.http.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server(tiny_model):
    """One shared server for the API tests; tests leave it idle, unpaused, default control."""
    s = ServerProcess(tiny_model)
    yield s
    assert s.stop() == 0, s.log


@pytest.fixture
def start_server(tiny_model):
    """Factory for a dedicated server (lifecycle tests that stop it); killed if a test fails."""
    started = []

    def start(*extra: str) -> ServerProcess:
        s = ServerProcess(tiny_model, *extra)
        started.append(s)
        return s
    yield start
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


@pytest.fixture
def sse():
    return sse_events


def sse_events(lines) -> list:
    """Parses `data: {json}` lines up to `data: [DONE]`; asserts the terminator came."""
    out = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        if data == "[DONE]":
            return out
        out.append(json.loads(data))
    raise AssertionError(f"stream ended without data: [DONE] after {len(out)} events")
