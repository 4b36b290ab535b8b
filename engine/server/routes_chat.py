"""OpenAI `/v1/chat/completions` (streaming too) for a model directory whose tokenizer has a chat
template: the messages (and `tools`, as the template renders them) become the prompt exactly as
transformers' `apply_chat_template(..., add_generation_prompt=True)` makes it, then generation runs
as any other request. The answer is the assistant's text; with `tools` (and `tool_choice` auto)
the calls Qwen 3 writes in its `<tool_call>` blocks come out as OpenAI `tool_calls` (tool_calls.py,
SGLang's `--tool-call-parser qwen25`), streaming too; `--tool-call-parser none` leaves them in the text."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Optional, Union

from aiohttp import web
from pydantic import ConfigDict, Field, StrictBool, StrictInt, model_validator

from .app import Server, error_response, json_response, read_json, server_of
from .bridge import Tracked
from .client_strings import header
from .protocol import PRIORITY_MAX, BadRequest, GenerateItem, StreamOptions, _Strict, _neutral, openai_sampling_params, version_meta
from .routes_native import sse, wait_finished
from .tool_calls import ToolStream, parse as parse_tool_calls


class ChatRequest(_Strict):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    messages: list[dict[str, Any]]
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1)   # 0 refused, as /v1/completions does
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[StrictInt] = None
    min_tokens: Optional[StrictInt] = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    seed: Optional[StrictInt] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: StrictBool = False
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    response_format: Optional[dict[str, Any]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    rollout_id: Optional[str] = None
    priority: StrictInt = Field(default=0, ge=-PRIORITY_MAX, le=PRIORITY_MAX)   # admission order, higher first

    @model_validator(mode="after")
    def _check(self):
        _neutral("n", self.n, (1,))
        _neutral("top_logprobs", self.top_logprobs, (None, 0))
        _neutral("response_format", self.response_format, (None,))
        if self.tool_choice not in (None, "auto", "none"):
            raise ValueError(f"tool_choice={self.tool_choice!r} is not supported (no constrained decoding here: "
                             "only 'auto' or 'none')")
        if not self.messages:
            raise ValueError("messages is empty")
        for i, m in enumerate(self.messages):
            if not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] needs a string role")
        return self

    def sampling_params(self) -> dict[str, Any]:
        # max_completion_tokens, OpenAI's newer name, wins
        limit = self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
        return openai_sampling_params(self, 128 if limit is None else limit)


def _flatten(messages: list[dict]) -> list[dict]:
    """OpenAI content parts ([{"type": "text", "text": ...}]) as the plain text templates expect."""
    out = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            if any(p.get("type") != "text" for p in c):
                raise BadRequest("only text content parts are supported (this engine has no vision input)")
            m = {**m, "content": "".join(p.get("text", "") for p in c)}
        out.append(m)
    return out


def prompt_ids(server: Server, req: ChatRequest) -> list[int]:
    tok = server.tokenizer
    if tok is None or tok.chat is None:
        raise BadRequest("/v1/chat/completions needs a tokenizer with a chat template (tokenizer.json and "
                         "chat_template.jinja or tokenizer_config.json's chat_template in the model directory)")
    try:
        text = tok.chat.render(_flatten(req.messages), req.tools, **(req.chat_template_kwargs or {}))
    except BadRequest:
        raise
    except Exception as e:   # the template's own checks (raise_exception) and Jinja errors
        raise BadRequest(f"chat template failed: {type(e).__name__}: {e}") from None
    ids = tok.encode(text)
    if not ids:
        raise BadRequest("the chat template rendered an empty prompt")
    return ids


def _finish(t: Tracked, tool_calls: bool = False) -> Optional[str]:
    """OpenAI's finish_reason; a natural stop after tool calls is `tool_calls` (as SGLang's)."""
    kind = t.finish_reason["type"] if t.finished and t.finish_reason else None
    return "tool_calls" if tool_calls and kind == "stop" else kind


def _parses_tools(server: Server, req: ChatRequest) -> bool:
    return bool(req.tools) and req.tool_choice != "none" and server.settings.tool_call_parser != "none"


async def chat_completions(request: web.Request) -> web.StreamResponse:
    server = server_of(request)
    req = await read_json(request, ChatRequest)
    if req.model is not None and req.model not in (server.settings.model_name, server.settings.model):
        raise BadRequest(f"model {req.model!r} is not served here (serving {server.settings.model_name!r})", 404)
    item = GenerateItem(input_ids=prompt_ids(server, req), sampling_params=req.sampling_params(), rid=None,
                        return_logprob=req.logprobs, priority=req.priority)
    tracked, queue = await server.submit([item], rollout_id=req.rollout_id or header(request, "X-Rollout-Id"))
    t = tracked[0]
    head = {"id": "chatcmpl-" + uuid.uuid4().hex, "created": int(time.time()), "model": server.settings.model_name}
    try:
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return await _stream(request, server, t, queue, head, usage,
                                 ToolStream(req.tools) if _parses_tools(server, req) else None)
        await wait_finished(tracked, queue)
        if t.failure:
            return error_response(*t.failure)
        text, calls = t.text(server.tokenizer.decode), []
        if _parses_tools(server, req):
            text, calls = parse_tool_calls(text, req.tools)
        message = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
        lps = {"content": [{"token": server.tokenizer.decode([i]), "logprob": lp}
                           for i, lp in zip(t.output_ids, t.logprobs)]} if req.logprobs else None
        return json_response({**head, "object": "chat.completion", "choices": [{
            "index": 0, "message": message, "logprobs": lps,
            "finish_reason": _finish(t, bool(calls)), "matched_stop": (t.finish_reason or {}).get("matched")}],
            "usage": _usage(t), "metadata": chat_metadata(t, server.weight_version)})
    finally:
        server.release(tracked, queue)


def chat_metadata(t: Tracked, current: str) -> dict[str, str]:
    """OpenAI's `metadata` is a Dict[str, str] (newer `openai` clients refuse anything else): the
    version spans joined as `version:start-end,...`."""
    v = version_meta(t.version_spans, current, len(t.output_ids))
    spans = ",".join(f"{s['version']}:{s['start']}-{s['end']}" for s in v["weight_versions"])
    return {"weight_version": v["weight_version"], "weight_versions": spans}


def _usage(t: Tracked) -> dict:
    return {"prompt_tokens": t.prompt_tokens, "completion_tokens": len(t.output_ids),
            "total_tokens": t.prompt_tokens + len(t.output_ids)}


async def _stream(request, server: Server, t: Tracked, queue: asyncio.Queue, head: dict,
                  include_usage: bool, tools: Optional[ToolStream]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    chunk = lambda delta, finish=None: sse({**head, "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})
    sent, called = "", False
    try:
        await resp.write(chunk({"role": "assistant", "content": ""}))
        while True:
            await queue.get()
            while not queue.empty():
                queue.get_nowait()
            text = t.text(server.tokenizer.decode)   # whole text: a split multi-byte char heals
            new, sent = text[len(sent):], text if len(text) > len(sent) else sent
            calls = []
            if tools is not None:   # held from a <tool_call> on until its block closes
                new, calls = tools.feed(new)
                new += tools.finish() if t.finished else ""
            for c in calls:
                await resp.write(chunk({"tool_calls": [c]}))
            called = called or bool(calls)
            if new or t.finished:
                await resp.write(chunk({"content": new} if new else {}, _finish(t, called)))
            if t.finished:
                break
        if include_usage:
            await resp.write(sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": _usage(t)}))
        await resp.write(b"data: [DONE]\n\n")
    except ConnectionResetError:
        return resp
    await resp.write_eof()
    return resp


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
