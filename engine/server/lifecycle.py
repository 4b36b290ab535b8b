"""What a supervisor (the kubelet) asks of a running server beyond /health:

  GET  /live?bound_s=S  200 while the engine thread's loop turned within S seconds (it turns at least
                        every IDLE_CHECK_S idle, after every step busy), or a command it runs (a weight
                        load) is still in progress, or the engine is still loading (the startup probe's
                        time); 503 once it has been silent longer: a wedged step loop.
  POST /drain           (admin) stop admitting (503 to new requests, /health 503 so the Service drops the
                        pod) and wait up to the drain timeout for in-flight requests; the SIGTERM that
                        follows counts its drain from here. A pod's preStop runs it:

      python3 -m pdrollout.engine.server.lifecycle drain --port 30000   (token from $PDROLLOUT_ADMIN_TOKEN_FILE)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.error
import urllib.request

from aiohttp import web

from ..protocol.auth import ADMIN_TOKEN_FILE_ENV
from .app import admin, json_response, server_of
from .client_strings import query
from .protocol import BadRequest

DEFAULT_LIVE_BOUND_S = 60.0


async def live(request: web.Request) -> web.Response:
    raw = query(request, "bound_s", str(DEFAULT_LIVE_BOUND_S))
    try:
        bound = float(raw)
    except ValueError:
        bound = -1.0
    if not bound > 0:
        raise BadRequest(f"bound_s must be a positive number of seconds, got {raw!r}")
    b = server_of(request).bridge
    now = time.monotonic()
    if b.state == "loading":
        return json_response({"status": "loading"})
    if b.state != "ready":   # failed or stopped: the process is ending with its exit code
        return json_response({"status": b.state}, 503)
    if b.command_since is not None:
        return json_response({"status": "ok", "command_s": round(now - b.command_since, 1)})
    silent = now - b.beat
    if silent > bound:
        return json_response({"status": "wedged", "silent_s": round(silent, 1), "bound_s": bound}, 503)
    return json_response({"status": "ok", "silent_s": round(silent, 1)})


async def drain(request: web.Request) -> web.Response:
    server = server_of(request)
    server.draining = True
    if server.drain_started is None:
        server.drain_started = time.monotonic()
    deadline = server.drain_started + server.settings.drain_timeout_s
    while server.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return json_response({"drained": not server.in_flight, "in_flight": server.in_flight})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/live", live)
    app.router.add_post("/drain", admin(drain))


def drain_command(host: str, port: int, token_file: str | None, timeout_s: float) -> int:
    """The preStop hook: POST /drain and wait for it. A worker node (no API: 404) has nothing to drain."""
    headers = {}
    if token_file:
        try:
            headers["Authorization"] = "Bearer " + open(token_file).read().strip()
        except OSError as e:
            print(f"pdrollout drain: {token_file}: {e.strerror}", file=sys.stderr)
            return 2
    req = urllib.request.Request(f"http://{host}:{port}/drain", data=b"", headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            print(f"pdrollout drain: {json.loads(r.read())}")
            return 0
    except urllib.error.HTTPError as e:
        if e.code == 404:
            print("pdrollout drain: no API on this node (a worker node): nothing to drain")
            return 0
        print(f"pdrollout drain: HTTP {e.code}: {e.read()[:300]!r}", file=sys.stderr)
    except (urllib.error.URLError, OSError) as e:   # not listening (yet, or any more): SIGTERM follows
        print(f"pdrollout drain: {e}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdrollout.engine.server.lifecycle")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("drain", help="drain this pod's server (a preStop hook)")
    d.add_argument("--host", default=os.environ.get("POD_IP") or "127.0.0.1")
    d.add_argument("--port", type=int, default=30000)
    d.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the drain's answer")
    d.add_argument("--admin-token-file", default=os.environ.get(ADMIN_TOKEN_FILE_ENV) or None)
    a = p.parse_args(argv)
    return drain_command(a.host, a.port, a.admin_token_file, a.timeout)


if __name__ == "__main__":
    sys.exit(main())
