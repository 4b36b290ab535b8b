"""Runs the server: listen at once (/health says 503 while the engine loads), load the engine
on its thread, serve until SIGTERM/SIGINT, then shut down gracefully: stop accepting, let
in-flight requests finish for up to `drain_timeout_s`, abort the rest (they end with
finish_reason abort), close connections, exit 0. If the engine fails, in-flight requests end with
an abort that says why and the exit code classifies the failure (protocol/exits.py), also when it
fails during that drain."""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from typing import Any, Callable, Optional

from aiohttp import web

from .app import Server, ServerSettings
from .routes import build_app, build_metrics_app
from ..protocol.shutdown import ABORT_WAIT_S, BRIDGE_STOP_S, RUNNER_SHUTDOWN_S
from .bridge import EngineUnavailable

log = logging.getLogger("pdrollout.server")


async def start(settings: ServerSettings, engine_factory: Callable[[], Any], tokenizer=None
                ) -> tuple[Server, web.AppRunner, str]:
    """Starts listening and loading; returns the server, its runner and its base URL."""
    server = Server(settings, engine_factory, asyncio.get_running_loop(), tokenizer)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    runner = web.AppRunner(build_app(server), handler_cancellation=True, access_log=None,
                           shutdown_timeout=RUNNER_SHUTDOWN_S)
    await runner.setup()
    await _site(runner, settings.host, settings.port).start()
    host, port = runner.addresses[0][:2]
    settings.port = port                     # --port 0: report the port actually bound
    if settings.metrics_port is not None:
        scrape = web.AppRunner(build_metrics_app(server), access_log=None)
        await scrape.setup()
        await _site(scrape, settings.host, settings.metrics_port).start()
        settings.metrics_port = scrape.addresses[0][1]
        server.metrics_runner = scrape
        log.info("/metrics also on http://%s:%d", host, settings.metrics_port)
    server.bridge.start()
    return server, runner, f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _site(runner: web.AppRunner, host: str, port: int) -> web.BaseSite:
    """`--host ::` listens on both stacks (asyncio's own `::` socket is IPv6 only), as a Go server's
    does: a pod of a dual-stack cluster is reached on either address; v4 peers show as ::ffff:a.b.c.d."""
    if host != "::":
        return web.TCPSite(runner, host, port)
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(("::", port))
    return web.SockSite(runner, sock)


async def shutdown(server: Server, runner: web.AppRunner) -> None:
    server.draining = True
    server.unpaused.set()                    # requests parked by a pause now get 503
    for site in list(runner.sites):
        await site.stop()                    # stop accepting connections
    # The engine can fail at any point of the stop (a peer's heartbeat lost mid-drain): a command
    # then raises, its in-flight requests end with the failure's abort, and `run` returns its code.
    try:
        if server.bridge.state == "ready":
            await server.bridge.set_paused(False)   # paused-in-place work must be able to drain
    except EngineUnavailable:
        pass
    if server.drain_started is None:
        server.drain_started = time.monotonic()
    # A preStop drain (POST /drain) started the clock: its time counts against this drain's.
    deadline = server.drain_started + server.settings.drain_timeout_s
    if server.in_flight:
        log.info("draining %d in-flight request(s) for up to %.0f s", server.in_flight,
                 server.settings.drain_timeout_s)
    while server.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if server.in_flight and server.bridge.state == "ready":
        try:
            n = await server.bridge.call(lambda e: e.abort_all())
            log.info("drain timeout: aborted %d request(s)", n)
        except EngineUnavailable:
            pass
        deadline = time.monotonic() + ABORT_WAIT_S
        while server.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    await runner.cleanup()
    if server.metrics_runner is not None:
        await server.metrics_runner.cleanup()
    await server.bridge.stop(BRIDGE_STOP_S)


async def run(settings: ServerSettings, engine_factory: Callable[[], Any], tokenizer=None,
              ready_message: Optional[Callable[[str], None]] = print, failure: Optional[list] = None) -> int:
    """Serve until SIGTERM/SIGINT or the engine fails; returns the exit code. `failure` (a list)
    receives the engine's error, for the caller's last line."""
    loop = asyncio.get_running_loop()
    server, runner, url = await start(settings, engine_factory, tokenizer)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready_message:
        ready_message(f"pdrollout serve: listening on {url} (loading {settings.model})")
    expiry = asyncio.create_task(server.rollout_expiry_loop())
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(server.bridge.ready.wait()),
             asyncio.create_task(server.bridge.failed.wait())]
    done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if waits[1] in done and ready_message:
        ready_message(f"pdrollout serve: ready on {url}")
        done, _ = await asyncio.wait([waits[0], waits[2]], return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    failed = server.bridge.state == "failed"
    if failed:
        log.error("%s", server.bridge.error)
    else:
        log.info("shutting down")
    expiry.cancel()
    await shutdown(server, runner)
    if server.bridge.state == "failed":   # before the stop, or during its drain: the group's verdict
        if not failed:
            log.error("failed while shutting down: %s", server.bridge.error)
        if failure is not None:
            failure.append(server.bridge.error)
        return server.bridge.exit_code
    return 0
