"""What the kubelet asks of an engine pod, over real HTTP on loopback: GET /live (the engine loop's
heartbeat, the liveness probe) and the preStop drain (POST /drain through the hook's own command),
after which SIGTERM does not drain a second time."""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import time

from serverproc import start_stream

TOKEN = "drain-test-token"
LONG = {"input_ids": [4, 8, 15, 16, 23, 42], "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
SHORT = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}}


def test_live_reports_the_engine_loops_heartbeat(server):
    r = server.http.get("/live", params={"bound_s": 5})
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    assert 0 <= r.json()["silent_s"] < 5
    # Idle, the loop still turns (every IDLE_CHECK_S): over a few seconds it never looks silent.
    for _ in range(10):
        assert server.http.get("/live", params={"bound_s": 2}).status_code == 200
        time.sleep(0.3)
    # A bound shorter than any real silence: the probe's answer is the wedged one, with the figures.
    r = server.http.get("/live", params={"bound_s": 1e-9})
    assert r.status_code == 503 and r.json()["status"] == "wedged" and r.json()["silent_s"] >= 0, r.text
    r = server.http.get("/live", params={"bound_s": "soon"})
    assert r.status_code == 400 and "bound_s" in r.json()["error"]["message"], r.text
    # Serving is untouched by the probe.
    r = server.http.post("/generate", json=SHORT)
    assert r.status_code == 200 and server.http.get("/live").status_code == 200


def _drain(url: str, token_file: str | None) -> subprocess.CompletedProcess:
    host, port = url.removeprefix("http://").split(":")
    env = {k: v for k, v in os.environ.items() if k != "PDROLLOUT_ADMIN_TOKEN_FILE"}
    if token_file:
        env["PDROLLOUT_ADMIN_TOKEN_FILE"] = token_file
    return subprocess.run([sys.executable, "-m", "pdrollout.engine.server.lifecycle", "drain", "--host", host,
                           "--port", port], capture_output=True, text=True, timeout=120, env=env)


def test_prestop_drain_then_sigterm_counts_one_drain(start_server, tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    drain_s = 4.0
    srv = start_server("--drain-timeout", str(drain_s), "--admin-token-file", str(token))
    # Without the token the hook is refused and says so; nothing changes.
    r = _drain(srv.url, None)
    assert r.returncode == 1 and "HTTP 401" in r.stderr, (r.stdout, r.stderr)
    assert srv.http.get("/health").json()["status"] == "ok"
    with cf.ThreadPoolExecutor(3) as pool:
        long_f = pool.submit(srv.http.post, "/generate", json=LONG)
        srv.wait_for(lambda s: s["num_running_reqs"] == 1, what="long request running")
        short_f = start_stream(pool, srv.url, SHORT)
        t0 = time.monotonic()
        hook = pool.submit(_drain, srv.url, str(token))
        # While the hook waits: unready (the Service drops the pod), still listening, no new work.
        deadline = time.monotonic() + 60   # the hook's Python starts first (slow on a busy machine)
        while srv.http.get("/health").json()["status"] != "draining":
            assert time.monotonic() < deadline, "not draining after POST /drain"
            time.sleep(0.05)
        assert srv.http.get("/health").status_code == 503
        refused = srv.http.post("/generate", json=SHORT)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert short_f.result()["meta_info"]["finish_reason"]["type"] == "length"
        done = hook.result()
        waited = time.monotonic() - t0
        # The long request outlives the drain: the hook returns at its deadline saying so.
        assert done.returncode == 0 and "'drained': False" in done.stdout and "'in_flight': 1" in done.stdout, \
            (done.stdout, done.stderr)
        assert waited >= drain_s - 0.5, waited
        # The kubelet's SIGTERM: the drain's time is spent, so it aborts at once (no second drain).
        t1 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        long_r = long_f.result()
    assert long_r.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert srv.proc.wait(30) == 0
    assert time.monotonic() - t1 < drain_s, "SIGTERM drained again after the preStop's drain"
    srv.http.close()
