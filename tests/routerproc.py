"""A real sglang-router (PyPI `sglang-router`, the Rust load balancer slime puts in front of its
engines) on 127.0.0.1, in front of real `pdrollout serve` workers.

The router is a separate program with its own dependencies, so it lives in a small venv of its own
under ${PDROLLOUT_CACHE:-~/.cache/pdrollout}/sglang-router-<version>, built once (~30 MB, ~1 min)."""
from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from pdrollout.engine.protocol.router import SGLANG_ROUTER_VERSION
from side_venv import side_venv


def router_python() -> Path:
    return side_venv(f"sglang-router-{SGLANG_ROUTER_VERSION}", f"sglang-router=={SGLANG_ROUTER_VERSION}", 900) \
        / "bin" / "python"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RouterProcess:
    """`python -m sglang_router.launch_router --worker-urls ... --policy POLICY`; ready once every
    worker is registered and healthy."""

    def __init__(self, worker_urls: list[str], policy: str, timeout: float = 60):
        port, metrics_port = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.logfile = tempfile.NamedTemporaryFile("w+", prefix="sglang-router-", suffix=".log")
        # not from the repository root: its operator/ package would shadow the standard library's
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen(
            [str(router_python()), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--worker-urls", *worker_urls, "--policy", policy, "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(metrics_port), "--health-check-interval-secs", "1"],
            stdout=self.logfile, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir())
        self._wait_workers(len(worker_urls), timeout)

    @property
    def log(self) -> str:
        self.logfile.seek(0)
        return self.logfile.read()

    def _wait_workers(self, n: int, timeout: float) -> None:
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"sglang-router exited {self.proc.returncode}:\n{self.log[-3000:]}"
            try:
                last = httpx.get(self.url + "/workers", timeout=5).json()
                if sum(1 for w in last.get("workers", []) if w.get("is_healthy")) == n:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"sglang-router did not register {n} healthy workers; last /workers {last}\n{self.log[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.logfile.close()
