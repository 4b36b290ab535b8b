"""OpenAI-compatible `/v1/completions` (token-id prompts) and `/v1/models`.

Without a tokenizer `text` is "" and the output tokens are in each choice's `token_ids` (vLLM's
extension); `logprobs.tokens` name tokens as `token_id:<id>` (vLLM's `return_tokens_as_token_ids`
format). `top_logprobs` is null: the engine reports only the sampled token's logprob."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Optional

from aiohttp import web

from .app import Server, error_response, json_response, read_json, server_of
from .bridge import Tracked
from .client_strings import header
from .protocol import BadRequest, CompletionRequest, GenerateItem, version_meta
from .routes_native import sse, wait_finished

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def _prompts(server: Server, req: CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str) or (isinstance(p, list) and isinstance(p[0], str)):
        if server.tokenizer is None:
            raise BadRequest("text prompts need a tokenizer: start the server with --tokenizer DIR, "
                             "or send the prompt as token ids")
        return [server.tokenizer.encode(s) for s in ([p] if isinstance(p, str) else p)]
    return [list(x) for x in p] if isinstance(p[0], list) else [list(p)]


def _token_name(server: Server, tok: int) -> str:
    return server.tokenizer.decode([tok]) if server.tokenizer else f"token_id:{tok}"


def _logprobs(server: Server, ids: list[int], lps: list[float], offset0: int) -> dict:
    names = [_token_name(server, t) for t in ids]
    offsets, pos = [], offset0
    for n in names:
        offsets.append(pos)
        pos += len(n) if server.tokenizer else 0
    return {"tokens": names, "token_logprobs": list(lps), "top_logprobs": None, "text_offset": offsets}


def _choice(server: Server, t: Tracked, since: int, want_logprobs: bool) -> dict:
    ids = t.output_ids[since:]
    text = t.text(server.tokenizer.decode, since) if server.tokenizer else ""
    fr = t.finish_reason if t.finished else None
    return {"index": t.index, "text": text,
            "logprobs": _logprobs(server, ids, t.logprobs[since:], 0) if want_logprobs else None,
            "finish_reason": _FINISH.get(fr["type"], fr["type"]) if fr else None,
            "stop_reason": fr.get("matched") if fr else None,
            "token_ids": ids}


def _usage(tracked: list[Tracked]) -> dict:
    p = sum(t.prompt_tokens for t in tracked)
    c = sum(len(t.output_ids) for t in tracked)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def completions(request: web.Request) -> web.StreamResponse:
    server = server_of(request)
    req = await read_json(request, CompletionRequest)
    if req.model is not None and req.model not in (server.settings.model_name, server.settings.model):
        raise BadRequest(f"model {req.model!r} is not served here (serving {server.settings.model_name!r})", 404)
    want_logprobs = req.logprobs is not None
    sp = req.sampling_params()
    items = [GenerateItem(input_ids=p, sampling_params=sp, rid=None, return_logprob=want_logprobs,
                          priority=req.priority)
             for p in _prompts(server, req)]
    rollout_id = req.rollout_id or header(request, "X-Rollout-Id")
    tracked, queue = await server.submit(items, rollout_id=rollout_id)
    head = {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
            "model": server.settings.model_name}
    try:
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return await _stream(request, server, tracked, queue, head, want_logprobs, usage)
        await wait_finished(tracked, queue)
        if len(tracked) == 1 and tracked[0].failure:
            return error_response(*tracked[0].failure)
        return json_response({**head, "choices": [_choice(server, t, 0, want_logprobs) for t in tracked],
                              "usage": _usage(tracked), "metadata": version_meta(
                                  tracked[0].version_spans, server.weight_version, len(tracked[0].output_ids))})
    finally:
        server.release(tracked, queue)


async def _stream(request, server: Server, tracked: list[Tracked], queue: asyncio.Queue, head: dict,
                  want_logprobs: bool, include_usage: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    sent = {t.rid: 0 for t in tracked}
    done: set[str] = set()
    try:
        while len(done) < len(tracked):
            t: Optional[Tracked] = await queue.get()
            batch = {id(t): t}
            while not queue.empty():
                t = queue.get_nowait()
                batch[id(t)] = t
            choices = []
            for t in batch.values():
                if t.rid in done or (len(t.output_ids) == sent[t.rid] and not t.finished):
                    continue
                choices.append(_choice(server, t, sent[t.rid], want_logprobs))
                sent[t.rid] = len(t.output_ids)
                if t.finished:
                    done.add(t.rid)
            if choices:
                await resp.write(sse({**head, "choices": choices}))
        if include_usage:
            await resp.write(sse({**head, "choices": [], "usage": _usage(tracked)}))
        await resp.write(b"data: [DONE]\n\n")
    except ConnectionResetError:
        return resp
    await resp.write_eof()
    return resp


async def models(request: web.Request) -> web.Response:
    server = server_of(request)
    info = await server.bridge.call(lambda e: e.model_info())
    return json_response({"object": "list", "data": [{
        "id": server.settings.model_name, "object": "model", "created": int(server.started),
        "owned_by": "pdrollout", "root": server.settings.model, "max_model_len": info.get("max_context_len")}]})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
