"""Client disconnects abort their requests; SIGTERM drains, then aborts, then exits 0."""
from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdrollout.engine.protocol.exits import EXIT_CONFIG
from serverproc import start_stream

LONG = {"input_ids": [4, 8, 15, 16, 23, 42], "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}


def _aborted_total(server) -> float:
    for fam in text_string_to_metric_families(server.http.get("/metrics").text):
        for s in fam.samples:
            if s.name == "pdrollout:requests_total" and s.labels == {"finish_reason": "abort"}:
                return s.value
    return 0.0


def _idle(server):
    return server.wait_for(lambda s: s["num_running_reqs"] + s["num_queue_reqs"] == 0 and s["kv_blocks_used"] == 0,
                           timeout=30, what="request aborted and KV freed")


def test_disconnect_mid_request_aborts_it(server):
    before = _aborted_total(server)
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps(LONG).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        server.wait_for(lambda s: s["num_running_reqs"] == 1 and s["kv_blocks_used"] > 0, what="running")
    _idle(server)
    assert _aborted_total(server) == before + 1


def test_disconnect_mid_stream_aborts_it(server):
    before = _aborted_total(server)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/generate", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(x for x in lines if x)           # a token came: it is running
            stats = server.stats()
            assert stats["num_running_reqs"] == 1, (first, stats, [x[-300:] for x in lines if x], server.log[-3000:])
    _idle(server)
    assert _aborted_total(server) == before + 1


def test_sigterm_drains_then_aborts_and_exits_zero(start_server):
    srv = start_server("--drain-timeout", "5")
    short = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
    with cf.ThreadPoolExecutor(2) as pool:
        long_f = pool.submit(srv.http.post, "/generate", json=LONG)
        srv.wait_for(lambda s: s["num_running_reqs"] == 1, what="long request running")
        # Streamed: its first chunk shows it running. 100 tokens end well inside the drain on a slow CPU.
        short_f = start_stream(pool, srv.url, short)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        # Draining: no new connections are accepted (the long request holds the drain open).
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                httpx.get(srv.url + "/health", timeout=1)
            except httpx.ConnectError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("server still accepts connections after SIGTERM")
        short_last, long_r = short_f.result(), long_f.result()
    assert "draining 2 in-flight request(s)" in srv.log, srv.log[-3000:]
    # The short request finished normally inside the drain window; the long one was aborted
    # when it ended and still got its partial output.
    assert short_last["meta_info"]["finish_reason"]["type"] == "length"
    assert short_last["meta_info"]["completion_tokens"] == 100
    assert long_r.status_code == 200
    meta = long_r.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and 0 < meta["completion_tokens"] < 3000
    assert srv.proc.wait(30) == 0
    assert 5 <= time.monotonic() - t0 < 25
    srv.http.close()


def test_engine_that_fails_to_load_exits_nonzero(tmp_path):
    """A model the engine cannot load: the process logs why and exits with the bad-configuration code
    (distributed/exits.py), so a supervisor can tell it from a crash."""
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    cmd = [sys.executable, "-c", "import sys; from pdrollout.engine.cli import main; sys.exit(main())",
           "serve", "--model", str(bad), "--port", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_CONFIG
    assert "config.json not found" in r.stderr and "ready on" not in r.stdout
