"""SGLang's native HTTP API, the subset RL clients (verl, slime, AReaL) and
`sglang.bench_serving` use. Streaming follows SGLang's default: every SSE chunk carries the
cumulative `output_ids` (and cumulative `output_token_logprobs`), unless the server runs with
`--incremental-streaming-output`, where each chunk carries only the new tokens."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from importlib import metadata

from aiohttp import web

from .app import Server, admin, error_response, json_response, read_json, server_of
from .bridge import Tracked
from .client_strings import header
from .protocol import (AbortRequest, BadRequest, ContinueRequest, GenerateItem, GenerateRequest, PauseRequest,
                       generate_response, version_meta)
from .server_info import engine_facts, public_settings, sglang_server_args

HEALTH_CHECK_PREFIX = "HEALTH_CHECK_"


def _version() -> str:
    try:
        return metadata.version("pdrollout")
    except metadata.PackageNotFoundError:
        return "dev"


async def wait_finished(tracked: list[Tracked], queue: asyncio.Queue) -> None:
    while not all(t.finished for t in tracked):
        await queue.get()


def item_body(server: Server, t: Tracked, *, since: int = 0) -> dict:
    ids = t.output_ids[since:]
    lps = t.logprobs[since:] if t.return_logprob else None
    text = t.text(server.tokenizer.decode, since) if server.tokenizer else ""
    body = generate_response(rid=t.rid, output_ids=ids, logprobs=lps,
                             finish_reason=t.finish_reason if t.finished else None,
                             prompt_tokens=t.prompt_tokens, cached_tokens=t.cached_tokens,
                             e2e_latency=t.e2e_latency, text=text,
                             versions=version_meta(t.version_spans, server.weight_version, len(t.output_ids)),
                             routed_experts=t.routed_experts if t.finished else None)
    body["meta_info"]["completion_tokens"] = len(t.output_ids)
    body["meta_info"].update(t.spec_meta)
    body["meta_info"]["served_by"] = server.served_by   # which engine of a fleet answered (bench's groups)
    return body


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def generate(request: web.Request) -> web.StreamResponse:
    server = server_of(request)
    req = await read_json(request, GenerateRequest)
    rollout_id = req.rollout_id or header(request, "X-Rollout-Id")
    items = req.items(server.tokenizer.encode if server.tokenizer else None)
    tracked, queue = await server.submit(items, rollout_id=rollout_id, log_metrics=req.log_metrics)
    try:
        if req.stream:
            return await _stream(request, server, tracked, queue, batched=req.batched)
        await wait_finished(tracked, queue)
        if not req.batched and tracked[0].failure:
            return error_response(*tracked[0].failure)
        bodies = [item_body(server, t) for t in tracked]
        return json_response(bodies if req.batched else bodies[0])
    finally:
        server.release(tracked, queue)


async def _stream(request, server: Server, tracked: list[Tracked], queue: asyncio.Queue,
                  *, batched: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    incremental = server.settings.incremental_streaming_output
    sent = {t.rid: 0 for t in tracked}
    done: set[str] = set()
    try:
        while len(done) < len(tracked):
            updated = {id(t): t for t in [await queue.get()]}
            while not queue.empty():          # coalesce what piled up while we were writing
                t = queue.get_nowait()
                updated[id(t)] = t
            for t in updated.values():
                if t.rid in done or (len(t.output_ids) == sent[t.rid] and not t.finished):
                    continue
                body = item_body(server, t, since=sent[t.rid] if incremental else 0)
                if batched:
                    body["index"] = t.index
                sent[t.rid] = len(t.output_ids)
                if t.finished:
                    done.add(t.rid)
                await resp.write(sse(body))
        await resp.write(b"data: [DONE]\n\n")
    except ConnectionResetError:
        return resp                           # client gone: release() aborts the rest
    await resp.write_eof()
    return resp


@admin
async def abort_request(request: web.Request) -> web.Response:
    req = await read_json(request, AbortRequest)
    server = server_of(request)
    if req.abort_all:
        n = await server.bridge.call(lambda e: e.abort_all())
    else:
        n = int(await server.bridge.call(lambda e: e.abort(req.rid, "aborted by /abort_request")))
    return json_response({"success": True, "aborted": n})


@admin
async def pause_generation(request: web.Request) -> web.Response:
    """SGLang's modes. abort: in-flight requests end with finish_reason abort (their partial
    output answered before this returns); in_place: no steps, running requests keep their KV;
    retract: running requests give their KV back and are recomputed after /continue_generation.
    In every mode new requests wait until /continue_generation."""
    req = await read_json(request, PauseRequest, allow_empty=True)
    server = server_of(request)
    server.unpaused.clear()
    n = retracted = 0
    if req.mode == "abort":
        n = await server.bridge.call(lambda e: e.abort_all())
        await server.wait_idle(30.0)
    else:
        retract = (lambda e: e.retract_all()) if req.mode == "retract" else None
        retracted = await server.bridge.set_paused(True, retract) or 0
    return json_response({"message": "Generation paused successfully.", "status": "ok", "success": True,
                          "mode": req.mode, "aborted": n, "retracted": retracted})


@admin
async def continue_generation(request: web.Request) -> web.Response:
    await read_json(request, ContinueRequest, allow_empty=True)
    server = server_of(request)
    await server.bridge.set_paused(False)
    server.unpaused.set()
    return json_response({"message": "Generation continued successfully.", "status": "ok", "success": True})


@admin
async def flush_cache(request: web.Request) -> web.Response:
    await read_json(request, allow_empty=True)
    server = server_of(request)
    paused = not server.unpaused.is_set()   # a paused engine's waiting requests are recomputed anyway
    ok = await server.bridge.call(lambda e: e.flush_cache(allow_waiting=paused))
    if not ok:
        raise BadRequest("cache not flushed: requests are still running")
    return json_response({"success": True, "message": "Cache flushed."})


async def health_generate(request: web.Request) -> web.Response:
    """Runs a one-token generation through the engine (skipped while paused)."""
    server = server_of(request)
    status, body = server.health()
    if status != 200:
        return json_response(body, status)
    if not server.unpaused.is_set():
        return json_response({"status": "ok", "paused": True})
    item = GenerateItem(input_ids=[0], sampling_params={"max_new_tokens": 1, "ignore_eos": True},
                        rid=HEALTH_CHECK_PREFIX + uuid.uuid4().hex, return_logprob=False)
    tracked, queue = await server.submit([item], log_metrics=False)
    try:
        await asyncio.wait_for(wait_finished(tracked, queue), server.settings.health_generate_timeout_s)
    except asyncio.TimeoutError:
        return json_response({"status": "generation timed out"}, 503)
    finally:
        server.release(tracked, queue)
    if len(tracked[0].output_ids) != 1:
        return json_response({"status": "generation failed", "finish_reason": tracked[0].finish_reason}, 503)
    return json_response({"status": "ok"})


async def get_model_info(request: web.Request) -> web.Response:
    server = server_of(request)
    info = await server.bridge.call(lambda e: e.model_info())
    tok = server.tokenizer.path if server.tokenizer else None
    return json_response({**info, "tokenizer_path": tok, "served_model_name": server.settings.model_name,
                          "is_generation": True,
                          "has_image_understanding": False, "has_audio_understanding": False,
                          "preferred_sampling_params": None})


async def get_server_info(request: web.Request) -> web.Response:
    server = server_of(request)
    stats = await server.bridge.snapshot()
    facts = await server.bridge.call(engine_facts)
    control = (await server.bridge.call(lambda e: e.requested_control)).model_dump()
    memory = await server.bridge.call(lambda e: {"bytes": e.memory(), "released": sorted(e.released)})
    tok = server.tokenizer.path if server.tokenizer else None
    return json_response({**public_settings(server.settings),
                          **sglang_server_args(server.settings, facts, tok), "version": _version(),
                          "weight_version": server.weight_version, "memory": memory,
                          "status": server.health()[1]["status"], "paused": not server.unpaused.is_set(),
                          "in_flight": server.in_flight, "held": server.held,
                          "admitting": server.admitting.is_set(), "uptime_s": time.time() - server.started,
                          "control": control, "internal_states": [stats]})


def _loads(engine) -> list[dict]:
    """SGLang's GetLoadsReqOutput per attention-DP replica (each has its own scheduler and KV pool)."""
    block, now = engine.config.block_size, time.time()
    out = []
    for rank, sched in enumerate(engine.schedulers):
        st = sched.stats()
        used, total = st["kv_blocks_used"] * block, st["kv_blocks_total"] * block
        pending = sum(len(r.prompt) + len(r.output) for r in sched.waiting)   # SGLang: used + waiting seqlens
        out.append({"dp_rank": rank, "timestamp": now, "num_running_reqs": st["num_running_reqs"],
                    "num_waiting_reqs": st["num_queue_reqs"], "num_used_tokens": used,
                    "num_total_tokens": used + pending, "max_total_num_tokens": total,
                    "token_usage": round(used / total, 4) if total else 0.0,
                    "max_running_requests": engine.config.max_running})
    return out


LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")   # SGLang's `include=` names


async def loads(request: web.Request) -> web.Response:
    """`include=` (SGLang's comma-separated sections; slime asks for `core`): the core fields are all
    this engine reports, so another section is refused by name rather than left out silently."""
    include = [x.strip() for x in request.query.get("include", "").split(",") if x.strip()]
    bad = [x for x in include if x not in LOAD_SECTIONS]
    if bad:
        raise BadRequest(f"include: unknown section(s) {bad}; valid: {', '.join(LOAD_SECTIONS)}")
    missing = [x for x in include if x not in ("core", "all")]
    if missing:
        raise BadRequest(f"include={','.join(missing)} is not reported by this server (only core)")
    loads = await server_of(request).bridge.call(_loads)
    return json_response({"timestamp": time.time(), "dp_rank_count": len(loads), "loads": loads})


async def get_load(request: web.Request) -> web.Response:
    """SGLang's older per-replica shape of the same loads: sglang-router's load monitor polls it."""
    loads = await server_of(request).bridge.call(_loads)
    return json_response([{"dp_rank": x["dp_rank"], "num_reqs": x["num_running_reqs"] + x["num_waiting_reqs"],
                           "num_waiting_reqs": x["num_waiting_reqs"], "num_tokens": x["num_total_tokens"],
                           "num_pending_tokens": x["num_total_tokens"] - x["num_used_tokens"],
                           "ts_tic": time.perf_counter()} for x in loads])


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_post("/generate", generate)
    r.add_post("/abort_request", abort_request)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    for path in ("/flush_cache",):
        r.add_post(path, flush_cache)
        r.add_get(path, flush_cache)
    r.add_get("/health_generate", health_generate)
    r.add_get("/v1/loads", loads)
    r.add_get("/get_load", get_load)
    for path in ("/get_model_info", "/model_info"):      # newer SGLang names without get_
        r.add_get(path, get_model_info)
    for path in ("/get_server_info", "/server_info"):
        r.add_get(path, get_server_info)
