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

SERVE = [sys.executable, "-c", "import sys; from pdrollout.engine.cli import main; sys.exit(main())", "serve"]


class ServerProcess:
    def __init__(self, model, *extra: str, env: dict | None = None):
        self.lines: list[str] = []
        self._ready: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen(
            [*SERVE, "--model", str(model), "--host", "127.0.0.1", "--port", "0", "--log-level", "info", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **(env or {})})
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

    def info(self) -> dict:
        return self.http.get("/get_server_info").json()

    def stats(self) -> dict:
        return self.info()["internal_states"][0]

    def wait_for(self, pred, timeout=60, what="condition", read=None):
        """Until `pred` holds of the engine's stats (or of what `read` returns, e.g. self.info)."""
        read = read or self.stats
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = read()
            if pred(s):
                return s
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; last read {s}")

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


def iter_sse(lines):
    """The events of `data: {json}` lines up to `data: [DONE]`; asserts the terminator came."""
    n = 0
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        n += 1
        yield json.loads(data)
    raise AssertionError(f"stream ended without data: [DONE] after {n} events")


def start_stream(pool, url: str, body: dict):
    """Submit `body` as a streamed /generate to `pool` and return once its first chunk came (so it is
    running), with the future of its last chunk. A poll of the stats can miss a request that lives
    only a few steps on a fast machine; the request's own stream cannot."""
    first = threading.Event()

    def read():
        last = None
        with httpx.Client(base_url=url, timeout=120) as c, \
                c.stream("POST", "/generate", json={**body, "stream": True}) as r:
            r.raise_for_status()
            for last in iter_sse(r.iter_lines()):
                first.set()
        return last

    done = pool.submit(read)
    while not first.wait(0.05):
        if done.done():
            raise AssertionError(f"stream ended before its first chunk: {done.result()}")
    return done
