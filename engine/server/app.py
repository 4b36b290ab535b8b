"""The aiohttp application: shared server state, JSON error handling, request submission, and
the operational routes (/health, /metrics, /control, /rollout/finish). The SGLang native and
OpenAI routes live in `routes_native` and `routes_openai`."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from aiohttp import web
from pydantic import BaseModel, ValidationError

from ..protocol.config import ControlSettings
from ..scheduler.request import RequestError, SamplingParams
from .auth import AuthPolicy
from .bridge import EngineBridge, EngineUnavailable, Tracked
from .client_strings import check_body
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import BadRequest, GenerateItem, RolloutFinishRequest, error_body, parse, validation_message
from .rollouts import RolloutTracker
from .stops import take_stop_strings

log = logging.getLogger("pdrollout.server")

SERVER_KEY = web.AppKey("pdrollout_server", object)


@dataclass
class ServerSettings:
    model: str
    served_model_name: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 30000
    mode: str = "pd"
    device: str = "cpu"
    max_body_bytes: int = 32 << 20
    drain_timeout_s: float = 30.0
    rollout_idle_s: float = 5.0
    incremental_streaming_output: bool = False   # SGLang's default: cumulative chunks
    health_generate_timeout_s: float = 20.0
    enable_memory_saver: bool = False            # SGLang's flag: release/resume_memory_occupation are served
    tool_call_parser: str = "qwen25"             # SGLang's flag: chat's tool calls out of Qwen's <tool_call>
    # required (Bearer) on the admin routes; None: they are open. Never returned or logged (server_info.py).
    admin_token: Optional[str] = field(default=None, repr=False)
    api_key: Optional[str] = field(default=None, repr=False)      # SGLang's --api-key (auth.py)
    admin_peers: tuple = ()                                        # trusted peer networks (auth.py)
    metrics_port: Optional[int] = None    # a second listener for /metrics alone (0: any free port)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


class Server:
    """Everything a handler needs; one per app."""

    def __init__(self, settings: ServerSettings, engine_factory: Callable[[], Any],
                 loop: asyncio.AbstractEventLoop, tokenizer=None):
        self.settings = settings
        self.auth = AuthPolicy(settings.admin_token, settings.api_key, settings.admin_peers)
        self.tokenizer = tokenizer
        self.metrics = ServerMetrics()
        self.rollouts = RolloutTracker(settings.rollout_idle_s, self._rollout_finished)
        self.bridge = EngineBridge(engine_factory, loop, self.metrics, on_finished=self._request_finished)
        self.started = time.time()
        self.draining = False
        self.drain_started: Optional[float] = None   # monotonic; the drain's deadline counts from here
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.admitting = asyncio.Event()     # cleared while an update waits for in-flight requests
        self.admitting.set()
        self.held = 0                        # requests waiting at the door (paused, or an update waits)
        self.update_lock = asyncio.Lock()    # one weight update (or memory op) at a time
        self.weight_version = "default"      # the engine's, mirrored for responses with no tokens
        self._background: set[asyncio.Task] = set()
        self.metrics_runner: Optional[web.AppRunner] = None   # --metrics-port's listener (serve.py)

    @property
    def served_by(self) -> str:
        """This engine's name in a fleet: its host (a pod's name) and the port it bound."""
        return f"{socket.gethostname()}:{self.settings.port}"

    # --- request lifecycle ------------------------------------------------------------------
    async def submit(self, items: list[GenerateItem], *, rollout_id: Optional[str] = None,
                     log_metrics: bool = True) -> tuple[list[Tracked], asyncio.Queue]:
        """Validates and submits a (batch) request atomically; returns its tracked states and
        the queue that wakes the handler on every update."""
        if self.draining:
            raise EngineUnavailable("server is shutting down")
        sampling, stops = [], []
        for i, item in enumerate(items):
            sp, stop = take_stop_strings(item.sampling_params, self.tokenizer, _where(i, len(items)))
            try:
                sampling.append(SamplingParams.from_dict(sp))
            except RequestError as e:
                raise BadRequest(_where(i, len(items)) + str(e)) from None
            stops.append(stop)
        self.held += 1
        try:
            while not (self.unpaused.is_set() and self.admitting.is_set()):
                await self.unpaused.wait()       # SGLang: requests wait while generation is paused
                await self.admitting.wait()      # ... and while an update waits for in-flight ones
        finally:
            self.held -= 1
        if self.draining:
            raise EngineUnavailable("server is shutting down")
        queue: asyncio.Queue = asyncio.Queue()
        now = time.monotonic()
        tracked = [Tracked(rid=item.rid or uuid.uuid4().hex, arrival=now, rollout_id=rollout_id,
                           log_metrics=log_metrics, return_logprob=item.return_logprob, index=i, wake=queue,
                           stops=stops[i], routes_from=item.routes_from)
                   for i, item in enumerate(items)]
        if len({t.rid for t in tracked}) != len(tracked):
            raise BadRequest("rid values of a batch must be distinct")
        for k, t in enumerate(tracked):
            try:
                self.bridge.track(t)
            except BadRequest:
                for done in tracked[:k]:
                    self.bridge.untrack(done.rid)
                raise

        def submit_all(engine):
            for i, (t, item, sp) in enumerate(zip(tracked, items, sampling)):
                try:
                    engine.submit(t.rid, item.input_ids, sp, return_logprob=item.return_logprob,
                                  rollout_id=rollout_id, routes_from=item.routes_from, priority=item.priority)
                except RequestError as e:
                    for prev in tracked[:i]:
                        engine.abort(prev.rid, "batch rejected")
                    raise BadRequest(_where(i, len(items)) + str(e)) from None
        try:
            await self.bridge.call(submit_all)
        except (BadRequest, EngineUnavailable):
            for t in tracked:
                self.bridge.untrack(t.rid)
            raise
        except BaseException:
            # Cancelled (client gone) while the engine thread may already have submitted: abort.
            self.release(tracked, queue)
            raise
        if rollout_id is not None:
            for t in tracked:
                self.rollouts.released(rollout_id, t.arrival)
                t.in_rollout = True
                if t.finished:   # done within one step, dispatched before this handler resumed
                    self._request_finished(t)
            self.metrics.rollouts_active.set(self.rollouts.active)
        return tracked, queue

    def release(self, tracked: list[Tracked], queue: asyncio.Queue) -> None:
        """The handler is done with these requests. Unfinished ones (client gone, handler
        cancelled) are aborted in the background so their KV is freed."""
        if all(t.finished for t in tracked):
            for t in tracked:
                self.bridge.untrack(t.rid)
            return
        task = asyncio.ensure_future(self._abandon(tracked, queue))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abandon(self, tracked: list[Tracked], queue: asyncio.Queue) -> None:
        rids = [t.rid for t in tracked if not t.finished]
        log.info("client gone: aborting %s", ", ".join(rids))
        try:
            await self.bridge.call(lambda e: [e.abort(rid, "client disconnected") for rid in rids])
            deadline = time.monotonic() + 5.0
            while not all(t.finished for t in tracked) and time.monotonic() < deadline:
                try:
                    await asyncio.wait_for(queue.get(), deadline - time.monotonic())
                except asyncio.TimeoutError:
                    break
        except EngineUnavailable:
            pass
        finally:
            now = time.monotonic()
            for t in tracked:
                if not t.finished:           # engine gone: settle the rollout books anyway
                    t.finished, t.finished_at = True, now
                    self._request_finished(t)
                self.bridge.untrack(t.rid)

    def _request_finished(self, t: Tracked) -> None:
        if t.in_rollout:
            t.in_rollout = False
            self.rollouts.completed(t.rollout_id, t.finished_at or time.monotonic())
            self.metrics.rollouts_active.set(self.rollouts.active)

    def _rollout_finished(self, summary: dict) -> None:
        self.metrics.rollout_finished(summary["makespan_s"], summary["num_requests"])

    async def rollout_expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(min(0.5, self.settings.rollout_idle_s / 4))
            self.rollouts.expire(time.monotonic())
            self.metrics.rollouts_active.set(self.rollouts.active)

    @property
    def in_flight(self) -> int:
        return len(self.bridge.tracked)

    async def wait_idle(self, timeout: float) -> bool:
        """Until no request is in flight (their answers sent); False after `timeout`."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return not self.in_flight

    async def exclusive(self, fn, abort_all: bool = False):
        """Runs `fn(engine)` as SGLang runs a weight update: with generation running, new requests
        wait and the ones in flight finish first (under the old weights); while paused it runs at
        once (paused requests continue under the new weights, as their weight_versions say).
        `abort_all` aborts the in-flight requests first."""
        async with self.update_lock:
            if abort_all:
                await self.bridge.call(lambda e: e.abort_all())
            if not self.unpaused.is_set():
                return await self.bridge.call(fn)
            self.admitting.clear()
            try:
                await self.wait_idle(float("inf"))
                return await self.bridge.call(fn)
            finally:
                self.admitting.set()

    def health(self) -> tuple[int, dict]:
        b = self.bridge
        if b.state == "ready" and not self.draining:
            return 200, {"status": "ok"}
        status = "draining" if self.draining else b.state
        body = {"status": status}
        if b.error:
            body["error"] = b.error
        return 503, body


def _where(i: int, n: int) -> str:
    return f"input {i}: " if n > 1 else ""


# --- HTTP helpers ---------------------------------------------------------------------------
def server_of(request: web.Request) -> Server:
    return request.app[SERVER_KEY]


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(body), status=status, content_type="application/json")


def error_response(message: str, status: int) -> web.Response:
    return json_response(error_body(message, status), status)


async def read_json(request: web.Request, model: Optional[type[BaseModel]] = None, *,
                    allow_empty: bool = False) -> Any:
    """The body as `model` (or the plain dict): malformed JSON, non-objects, unknown fields,
    wrong types -> 400; over the size limit -> 413."""
    limit = server_of(request).settings.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise BadRequest(f"request body of {request.content_length} bytes exceeds the limit of {limit} bytes", 413)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest(f"request body exceeds the limit of {limit} bytes", 413) from None
    if not raw.strip():
        if allow_empty:
            return parse(model, {}) if model else {}
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"malformed JSON: {e}") from None
    except RecursionError:   # json's decoder recurses per nesting level: a client's mistake, not ours
        raise BadRequest("malformed JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    check_body(body)
    return parse(model, body) if model else body


def admin(handler):
    """Marks a route that changes the engine for everyone (controls, pause, weights, memory, aborts):
    who may call it is auth.py's policy (admin token, api key, trusted peers)."""
    handler.admin = True
    return handler


def is_admin(handler) -> bool:
    return getattr(handler, "admin", False)


@web.middleware
async def auth_middleware(request: web.Request, handler):
    refused = server_of(request).auth.refusal(admin=is_admin(request.match_info.handler), path=request.path,
                             remote=request.remote, headers=request.headers)
    if refused is not None:
        status, why = refused
        resp = error_response(f"{request.method} {request.path} {why}", status)
        if status == 401:
            resp.headers["WWW-Authenticate"] = 'Bearer realm="pdrollout-admin"'
        return resp
    return await handler(request)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except BadRequest as e:
        return error_response(str(e), e.status)
    except EngineUnavailable as e:
        return error_response(str(e), 503)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(f"{e.reason}: {request.method} {request.path}", e.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:   # a bug: report it, keep serving
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(f"internal error: {type(e).__name__}: {e}", 500)


# --- operational routes ---------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    status, body = server_of(request).health()
    return json_response(body, status)


async def metrics(request: web.Request) -> web.Response:
    body = server_of(request).metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _latest_control(engine) -> ControlSettings:
    # set_control applies at the next step boundary; report (and build on) what will apply.
    return engine.requested_control


async def get_control(request: web.Request) -> web.Response:
    control = await server_of(request).bridge.call(_latest_control)
    return json_response(control.model_dump())


@admin
async def put_control(request: web.Request) -> web.Response:
    changes = await read_json(request)
    server = server_of(request)

    def apply(engine):
        # Validated as a whole against the latest settings: an invalid key changes nothing.
        try:
            new = _latest_control(engine).updated(changes)
        except ValidationError as e:
            raise BadRequest(validation_message(e)) from None
        engine.set_control(new)
        return new
    new = await server.bridge.call(apply)
    log.info("control set to %s", new.model_dump())
    return json_response(new.model_dump())


async def rollout_finish(request: web.Request) -> web.Response:
    req = await read_json(request, RolloutFinishRequest)
    server = server_of(request)
    try:
        summary = server.rollouts.finish(req.rollout_id)
    except KeyError:
        raise BadRequest(f"unknown rollout_id {req.rollout_id!r}", 404) from None
    server.metrics.rollouts_active.set(server.rollouts.active)
    return json_response(summary)


async def rollouts(request: web.Request) -> web.Response:
    server = server_of(request)
    return json_response({"active": server.rollouts.active, "recent": list(server.rollouts.recent)})
