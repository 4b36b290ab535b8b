"""The engine thread and its bridge to asyncio.

The Engine is synchronous and not thread-safe, so exactly one thread touches it: it runs queued
commands (submit, abort, control, ...) between steps, runs `engine.step()` while there is work,
and sleeps on a condition when idle. Outputs go back to the event loop with `call_soon_threadsafe`,
where `Tracked` keeps each request's cumulative state and wakes its handler.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..protocol.exits import EXIT_ERROR, EXIT_STALL, exit_code, name as exit_name
from .metrics import ServerMetrics

log = logging.getLogger("pdrollout.server")
IDLE_CHECK_S = 0.5   # how often an idle engine thread asks a multi-rank group whether it failed


class EngineUnavailable(RuntimeError):
    """The engine is loading, failed, or stopped: the server answers 503."""


@dataclass
class Tracked:
    """One request as the HTTP side sees it (cumulative; lives on the event loop)."""

    rid: str
    arrival: float
    rollout_id: Optional[str] = None
    log_metrics: bool = True
    return_logprob: bool = False
    index: int = 0                       # position in a batch request
    in_rollout: bool = False             # counted in its rollout's in-flight requests
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False
    finish_reason: Optional[dict] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None
    finished_at: Optional[float] = None
    wake: Optional[asyncio.Queue] = None  # gets `self` after every update
    version_spans: list = field(default_factory=list)   # [version, start, end) over output_ids
    routed_experts: Optional[bytes] = None
    spec_meta: dict = field(default_factory=dict)   # speculation's meta_info keys (RequestOutput.spec_meta)
    stops: Any = None                    # stops.StopStrings, or None
    stop_matched: Optional[str] = None   # a stop string ended it: later tokens are dropped, the engine aborts it
    routes_from: Optional[int] = None    # return_routed_experts: its first position
    engine_tokens: int = 0               # tokens the engine produced (output_ids may keep fewer)

    def text(self, decode, since: int = 0) -> str:
        """The output's text from token `since`, cut at a matched stop string as its request asked."""
        text = decode(self.output_ids[since:])
        if self.stop_matched is not None and self.finished:
            text = self.stops.trim(text, self.stop_matched)
        return text

    def add_tokens(self, ids: list[int], version: str) -> None:
        """Appends tokens produced by the weights of `version` (a request spanning an update gets
        one span per version, as SGLang's meta_info.weight_versions)."""
        start = len(self.output_ids)
        self.output_ids.extend(ids)
        if self.version_spans and self.version_spans[-1][0] == version:
            self.version_spans[-1][2] = len(self.output_ids)
        else:
            self.version_spans.append([version, start, len(self.output_ids)])

    @property
    def failure(self) -> Optional[tuple[str, int]]:
        """(message, HTTP status) when the server failed this request (finish_reason's status_code)."""
        fr = self.finish_reason or {}
        return (fr.get("message", "request failed"), fr["status_code"]) if fr.get("status_code") else None

    @property
    def e2e_latency(self) -> Optional[float]:
        return None if self.finished_at is None else self.finished_at - self.arrival


class EngineBridge:
    def __init__(self, engine_factory: Callable[[], Any], loop: asyncio.AbstractEventLoop,
                 metrics: ServerMetrics, on_finished: Callable[[Tracked], None] = lambda t: None):
        self._factory = engine_factory
        self._loop = loop
        self._metrics = metrics
        self._on_finished = on_finished
        self._cond = threading.Condition()
        self._inbox: deque[tuple[Callable, asyncio.Future]] = deque()
        self._stopping = False
        self._paused = False               # in-place pause: no steps, KV kept
        self._thread = threading.Thread(target=self._run, name="pdrollout-engine", daemon=True)
        self.engine = None                 # touched only by the engine thread after start()
        self.state = "loading"             # loading | ready | failed | stopped
        self.error: Optional[str] = None
        self.exit_code = 0                 # the process's exit code once failed (protocol/exits.py)
        self.ready = asyncio.Event()
        self.failed = asyncio.Event()
        self.tracked: dict[str, Tracked] = {}
        self.last_stats: dict = {}
        self.beat = time.monotonic()       # the engine thread's last pass of its loop (GET /live)
        self.command_since: Optional[float] = None   # a command (weight load...) runs on the thread

    # --- lifecycle (event loop side) --------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    async def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        # An engine still loading (a model read, a group joining) cannot be stopped midway, and waiting for
        # it kept node 0's group store open for up to `timeout` after SIGTERM, where the next start of the
        # group's other nodes could join it. The process leaves after this; the daemon thread goes with it.
        if self.state != "loading":
            await asyncio.to_thread(self._thread.join, timeout)
        if self.state != "failed":
            self.state = "stopped"

    # --- commands ---------------------------------------------------------------------------
    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Runs `fn(engine)` on the engine thread between steps; returns or raises its result."""
        if self.state != "ready":
            raise EngineUnavailable(self.error or f"engine is {self.state}")
        fut = self._loop.create_future()
        with self._cond:
            self._inbox.append((fn, fut))
            self._cond.notify()
        return await fut

    def fire(self, fn: Callable[[Any], Any]) -> None:
        """Runs `fn(engine)` on the engine thread between steps; nobody waits for it."""
        if self.state != "ready":
            return
        fut = self._loop.create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())   # its error is nobody's
        with self._cond:
            self._inbox.append((fn, fut))
            self._cond.notify()

    async def set_paused(self, paused: bool, then=None):
        """Pauses (or not) between two steps; `then(engine)` runs in the same command (a retract
        that no step may undo) and its result is returned."""
        def apply(engine):
            self._paused = paused
            return then(engine) if then is not None else None
        return await self.call(apply)

    async def snapshot(self) -> dict:
        """engine.stats() plus whether generation is paused in place."""
        return await self.call(lambda e: {**e.stats(), "paused": self._paused})

    @property
    def paused_in_place(self) -> bool:
        return self._paused

    def track(self, t: Tracked) -> None:
        if t.rid in self.tracked:
            from .protocol import BadRequest
            raise BadRequest(f"request id {t.rid!r} is already running")
        self.tracked[t.rid] = t

    def untrack(self, rid: str) -> None:
        self.tracked.pop(rid, None)

    # --- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as e:  # the server stays up and reports why on /health
            code = exit_code(e)
            self._fail(f"engine failed to load ({exit_name(code)}): {type(e).__name__}: {e}", code)
            log.error("engine failed to load\n%s", traceback.format_exc())
            return
        if hasattr(self.engine, "on_exit"):   # a group failure that ends this process answers first
            self.engine.on_exit(self._last_words)
        ranks = getattr(self.engine, "ranks", None)
        if getattr(ranks, "counters", None) is not None:   # node 0's ranks on /metrics
            codes = (lambda: {0: None, **ranks.local.codes()}) if ranks.local else (lambda: {0: None})
            self._metrics.add_ranks(ranks.counters, codes, ranks.layout)
        self._publish_stats()
        self._loop.call_soon_threadsafe(self._set_ready)
        engine = self.engine
        check = getattr(engine, "check", lambda: None)   # a multi-rank group can fail while idle
        while True:
            self.beat = time.monotonic()
            with self._cond:
                while (not self._inbox and not self._stopping
                       and (self._paused or engine.released or not engine.has_unfinished())):
                    self._cond.wait(IDLE_CHECK_S)
                    self.beat = time.monotonic()
                    try:
                        check()
                    except Exception as e:
                        code = self._verdict(e)
                        self._fail(f"engine failed ({exit_name(code)}): {type(e).__name__}: {e}{self._cause(e)}", code)
                        return
                cmds = list(self._inbox)
                self._inbox.clear()
                stopping = self._stopping
            for fn, fut in cmds:
                self.command_since = time.monotonic()
                try:
                    res, exc = fn(engine), None
                except Exception as e:   # handed to the awaiting handler (RequestError -> 400)
                    res, exc = None, e
                self.command_since = None
                self._loop.call_soon_threadsafe(_settle, fut, res, exc)
            if stopping:
                break
            try:
                # Paused in place: no new step, but aborted requests still get their final output.
                outs = engine.finish(None) if self._paused or engine.released else (
                    engine.step() if engine.has_unfinished() else [])
            except Exception as e:
                log.error("engine step failed\n%s", traceback.format_exc())
                code = self._verdict(e)
                self._fail(f"engine step failed ({exit_name(code)}): {type(e).__name__}: {e}{self._cause(e)}", code)
                return
            records = engine.records[:]
            engine.records.clear()
            hold = None if outs or records or self._paused or engine.released else getattr(engine, "hold_until", None)
            if hold is not None:   # nothing ran, the planner holds arrivals back: sleep until then or new
                with self._cond:   # input, not spin (a spinning loop holds the GIL the HTTP side needs)
                    if not self._inbox and not self._stopping:
                        self._cond.wait(max(0.0, hold - time.monotonic()))
            if records:
                self._metrics.record_steps(records)
            if cmds or outs or records:
                self._publish_stats()        # before the outputs: a client never sees stale gauges
            if outs:
                self._loop.call_soon_threadsafe(self._dispatch, outs, time.monotonic())

    def _publish_stats(self) -> None:
        stats = dict(self.engine.stats())
        stats["paused"] = self._paused
        self.last_stats = stats          # a dict swap: readers on the loop see old or new
        self._metrics.set_engine_stats(stats)

    def _verdict(self, e: BaseException) -> int:
        verdict = getattr(self.engine, "verdict", None)
        return verdict(e) if verdict is not None else exit_code(e)

    def _cause(self, e: BaseException) -> str:
        """The group's recorded failure, when this rank only saw its effect (a closed connection)."""
        cause = getattr(self.engine, "cause", lambda: None)()
        return f"; cause: {cause}" if cause and cause not in str(e) else ""

    def _last_words(self, err: BaseException, code: int) -> None:
        """Runs on the watchdog's thread before a forced exit: fail the in-flight requests and give
        the event loop a moment to send their answers."""
        done = threading.Event()
        # a P epoch in flight can see a peer's exit first: name the group's recorded cause too
        self._fail(f"engine failed ({exit_name(code)}): {type(err).__name__}: {err}{self._cause(err)}", code)
        self._loop.call_soon_threadsafe(done.set)
        done.wait(2.0)
        time.sleep(0.5)

    def _fail(self, message: str, code: int = EXIT_ERROR) -> None:
        if code == EXIT_STALL:
            self._metrics.stalls.inc()

        def on_loop():
            if self.state == "failed":
                return
            self.state, self.error, self.exit_code = "failed", message, code
            self.failed.set()
            for t in list(self.tracked.values()):
                if not t.finished:
                    self._finish(t, {"type": "abort", "message": message}, time.monotonic())
            with self._cond:
                for _, fut in self._inbox:
                    _settle(fut, None, EngineUnavailable(message))
                self._inbox.clear()
        self._loop.call_soon_threadsafe(on_loop)

    def _set_ready(self) -> None:
        if self.state == "loading":
            self.state = "ready"
            self.ready.set()

    # --- event loop side --------------------------------------------------------------------
    def _dispatch(self, outs: list, now: float) -> None:
        for o in outs:
            t = self.tracked.get(o.rid)
            if t is None or t.finished:
                continue
            try:
                self._apply(t, o, now)
            except Exception as err:   # this request alone fails; the batch's other outputs go on
                log.error("request %r: output processing failed\n%s", t.rid, traceback.format_exc())
                if not t.finished:
                    self.fire(lambda e, rid=t.rid: e.abort(rid, "output processing failed"))
                    self._finish(t, {"type": "abort", "status_code": 500,
                                     "message": f"output processing failed: {type(err).__name__}: {err}"}, now)

    def _apply(self, t: Tracked, o, now: float) -> None:
        """One engine output into its request's state: tokens, stop strings, metrics, its end."""
        t.prompt_tokens, t.cached_tokens = o.prompt_tokens, o.cached_tokens
        new, new_lps = o.new_token_ids, o.new_logprobs
        t.engine_tokens += len(new)
        if t.stop_matched is not None:
            new = new_lps = []            # past the stop string: the engine's abort is on its way
        elif t.stops is not None and new:
            hit = t.stops.first_match(t.output_ids, new)
            if hit is not None:
                new, new_lps = new[:hit[0]], new_lps[:hit[0]] if new_lps else new_lps
                t.stop_matched = hit[1]
                if not o.finished:
                    self.fire(lambda e, rid=t.rid: e.abort(rid, "stop string matched"))
        if new:
            if t.first_token_at is None:
                t.first_token_at = now
                if t.log_metrics:
                    self._metrics.first_token(now - t.arrival)
            elif t.log_metrics and t.last_token_at is not None:
                self._metrics.inter_token(now - t.last_token_at, len(o.new_token_ids))
            t.last_token_at = now
            t.add_tokens(new, o.weight_version)
            if t.return_logprob and new_lps:
                t.logprobs.extend(new_lps)
            if t.log_metrics:
                self._metrics.generated(len(new))
        if o.routed_experts is not None:
            t.routed_experts = _routes_kept(t, o.routed_experts)
        if o.spec is not None:
            t.spec_meta = o.spec_meta()
        if o.finished:
            stop = {"type": "stop", "matched": t.stop_matched} if t.stop_matched is not None else None
            self._finish(t, stop or o.finish_reason, now)
        elif t.wake is not None:
            t.wake.put_nowait(t)

    def _finish(self, t: Tracked, reason: Optional[dict], now: float) -> None:
        t.finished, t.finish_reason, t.finished_at = True, reason or {"type": "abort"}, now
        if t.log_metrics:
            self._metrics.request_finished(t.e2e_latency, t.prompt_tokens, t.cached_tokens,
                                           t.finish_reason.get("type", "abort"))
        self._on_finished(t)
        if t.wake is not None:
            t.wake.put_nowait(t)


def _routes_kept(t: Tracked, routes: bytes) -> bytes:
    """The routed experts of the positions a stop string kept: one position less per dropped token
    (the engine reports positions [routes_from, prompt + its tokens - 1))."""
    dropped = t.engine_tokens - len(t.output_ids)
    positions = t.prompt_tokens + t.engine_tokens - 1 - (t.routes_from or 0)
    if dropped <= 0 or positions <= 0:
        return routes
    return routes[:len(routes) - dropped * (len(routes) // positions)]


def _settle(fut: asyncio.Future, res: Any, exc: Optional[BaseException]) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(res)
