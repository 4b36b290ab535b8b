"""Issue 62, Must show 1: one bad request never harms another. Every string field of every route's body
(keys too, however deep), the headers and query parameters the routes read, get a lone UTF-16 surrogate,
a NUL and an overlong string, while normal requests run beside them: each poisoned request is a 400
naming its field (prompt content takes a NUL as text, engine/server/client_strings.py), the server stays
up, and every normal request returns exactly its baseline tokens.

The route table comes from the app itself: a route that reads a body and has no sample here fails the
test, as does a sample that leaves out a string-typed field of its model."""
from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, Literal, get_args, get_origin

import httpx
import pytest

from pdrollout.engine.server import protocol as P
from pdrollout.engine.server.app import Server, ServerSettings
from pdrollout.engine.server.client_strings import CONTENT_KEYS, STRING_MAX_CHARS
from pdrollout.engine.server.routes import build_app
from pdrollout.engine.server.routes_chat import ChatRequest
from server.piece_tokenizer import piece_model
from serverproc import ServerProcess, iter_sse

pytestmark = pytest.mark.timeout(600)
SURROGATE, NUL, LONG = "\ud800", "\x00", "x" * (STRING_MAX_CHARS + 1)
MODEL = "served-name"
SP = {"max_new_tokens": 4, "temperature": 0, "stop": ["zz"], "ignore_eos": True}
# (method, path) -> (its body's model, valid bodies that together set every string field; a field that
# takes only None is None); None: a raw JSON object
SAMPLES: dict[tuple[str, str], tuple] = {
    ("POST", "/generate"): (P.GenerateRequest, {
        "text": "ab ce", "sampling_params": SP, "rid": "r-1", "rollout_id": "roll-1", "model": MODEL,
        "input_ids": None, "return_logprob": None, "logprob_start_len": None, "top_logprobs_num": None,
        "token_ids_logprob": None, "image_data": None, "lora_path": None, "custom_logit_processor": None,
        "priority": None}),
    ("POST", "/v1/completions"): (P.CompletionRequest, {
        "prompt": "ab ce", "model": MODEL, "stop": ["zz", "yy"], "user": "u", "rollout_id": "roll-2",
        "suffix": None, "logit_bias": None, "max_tokens": 4}),   # both take only None
    ("POST", "/v1/chat/completions"): (ChatRequest, {
        "model": MODEL, "messages": [{"role": "user", "content": "ab"},
                                   {"role": "assistant", "content": [{"type": "text", "text": "ce"}],
                                    "tool_calls": [{"id": "c1", "type": "function",
                                                    "function": {"name": "f", "arguments": "{}"}}]}],
        "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}],
        "tool_choice": "auto", "stop": "zz", "user": "u", "rollout_id": "roll-3", "response_format": None,
        "chat_template_kwargs": {"enable_thinking": "no"}, "max_tokens": 4}),
    ("POST", "/abort_request"): (P.AbortRequest, {"rid": "r-9"}),
    ("POST", "/pause_generation"): (P.PauseRequest, {"mode": "abort", "rid": "r"}),
    ("POST", "/continue_generation"): (P.ContinueRequest, {"rid": "r"}),
    ("POST", "/flush_cache"): (None, {"rid": "r"}),
    ("POST", "/update_weights_from_disk"): (P.UpdateFromDiskRequest, {
        "model_path": "/nonexistent", "load_format": "auto", "weight_version": "v", "manifest": None,
        "rid": "r"}),
    ("POST", "/init_weights_update_group"): (P.InitGroupRequest, {
        "master_address": "127.0.0.1", "master_port": "1", "rank_offset": 1, "world_size": 2,
        "group_name": "g", "backend": "gloo", "rid": "r"}),
    ("POST", "/update_weights_from_distributed"): (P.UpdateFromDistributedRequest, {
        "names": ["w"], "dtypes": ["bfloat16"], "shapes": [[1]], "group_name": "g", "weight_version": "v",
        "load_format": None, "selector": "all", "rid": "r"}, {   # SkyRL's one tensor a request
        "name": "w", "dtype": "bfloat16", "shape": [1], "group_name": "g"}),
    ("POST", "/update_weights_from_tensor"): (P.UpdateFromTensorRequest, {
        "serialized_named_tensors": ["QUJD"], "load_format": "direct", "weight_version": "v", "rid": "r"}),
    ("POST", "/destroy_weights_update_group"): (P.DestroyGroupRequest, {"group_name": "g", "rid": "r"}),
    ("POST", "/update_weight_version"): (P.UpdateWeightVersionRequest, {"new_version": "v", "rid": "r"}),
    ("POST", "/release_memory_occupation"): (P.MemoryRequest, {"tags": ["kv_cache"], "rid": "r"}),
    ("POST", "/resume_memory_occupation"): (P.MemoryRequest, {"tags": ["kv_cache"], "rid": "r"}),
    ("POST", "/rollout/finish"): (P.RolloutFinishRequest, {"rollout_id": "roll-1"}),
    ("PUT", "/control"): (None, {"activation": "auto", "ordering": "fine-grained", "span": "auto"}),
}
NO_BODY = {("POST", "/drain")}   # reads no body (and drains the server it is sent to)
HEADERS = {("POST", "/generate"): "X-Rollout-Id", ("POST", "/v1/completions"): "X-Rollout-Id",
           ("POST", "/v1/chat/completions"): "X-Rollout-Id"}
GENERATION = ("/generate", "/v1/completions", "/v1/chat/completions")
HEADER_BODIES = {"/generate": {"text": "ab", "sampling_params": SP}, "/v1/completions": {"prompt": "ab", "max_tokens": 2},
                 "/v1/chat/completions": {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2}}
QUERIES = {("GET", "/live"): "bound_s"}
NORMAL = {"input_ids": [3, 1, 4, 1, 5, 9, 2, 6], "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                                                     "ignore_eos": True}}


def body_routes() -> set[tuple[str, str]]:
    server = Server(ServerSettings(model="m"), lambda: None, asyncio.new_event_loop())
    return {(r.method, r.resource.canonical) for r in build_app(server).router.routes()
            if r.method in ("POST", "PUT")}


def holds_strings(annotation) -> bool:
    """str, Any, a Literal of strings, a dict, or a container or union of one of these."""
    if annotation is str or annotation is Any or annotation is dict or get_origin(annotation) is dict:
        return True
    if get_origin(annotation) is Literal:
        return any(isinstance(a, str) for a in get_args(annotation))
    return any(holds_strings(a) for a in get_args(annotation))


def string_fields(model) -> set[str]:
    return {name for name, f in model.model_fields.items() if holds_strings(f.annotation)}


def leaves(value, path=(), content=False, tree=False):
    """(path, is_content) of every string, and ((path, key), "key") of every dict key. Content: the
    value of a content key (or its list's items), or anything under a tool definition."""
    if isinstance(value, str):
        yield path, content or tree
    elif isinstance(value, dict):
        for k, v in value.items():
            yield (path, k), "key"
            yield from leaves(v, path + (k,), k in CONTENT_KEYS, tree or k == "tools")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from leaves(v, path + (i,), content, tree)


def name(path) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def poisoned(body, path, poison, key: bool):
    body = json.loads(json.dumps(body))
    if key:
        parent, k = path
        d = body
        for p in parent:
            d = d[p]
        d[k + poison if poison != LONG else LONG] = d.pop(k)
        return body
    d = body
    for p in path[:-1]:
        d = d[p]
    d[path[-1]] = (d[path[-1]] + poison) if poison != LONG else LONG
    return body


@pytest.fixture(scope="module")
def text_server(tiny_model, tmp_path_factory):
    """The tiny model with a tokenizer and a chat template (text, prompt and chat content are tokenized)."""
    d = tmp_path_factory.mktemp("strings")
    fast = piece_model(tiny_model, d, extra="\x00", chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")
    s = ServerProcess(d, "--served-model-name", MODEL)
    yield s, fast
    assert s.stop() == 0, s.log[-5000:]


class Beside:
    """Normal requests (plain and streamed) in a loop while the test runs; each must equal the baseline."""

    def __init__(self, s: ServerProcess):
        self.baseline = s.http.post("/generate", json=NORMAL).json()["output_ids"]
        self.url, self.done, self.runs, self.bad = s.url, threading.Event(), 0, []
        self.threads = [threading.Thread(target=self._loop, args=(stream,)) for stream in (False, True, False)]
        for t in self.threads:
            t.start()

    def _loop(self, stream: bool):
        with httpx.Client(base_url=self.url, timeout=120) as c:
            while not self.done.is_set():
                if stream:
                    with c.stream("POST", "/generate", json={**NORMAL, "stream": True}) as r:
                        ids = list(iter_sse(r.iter_lines()))[-1]["output_ids"]
                else:
                    ids = c.post("/generate", json=NORMAL).json()["output_ids"]
                self.runs += 1
                if ids != self.baseline:
                    self.bad.append(ids)

    def stop(self):
        self.done.set()
        for t in self.threads:
            t.join()
        assert not self.bad and self.runs >= 3, (self.runs, self.bad[:2], self.baseline)


def test_every_route_that_reads_a_body_has_a_full_sample():
    assert body_routes() - NO_BODY == set(SAMPLES), body_routes() - NO_BODY ^ set(SAMPLES)
    for route, (model, *bodies) in SAMPLES.items():
        if model is not None:
            given = set().union(*bodies)
            assert string_fields(model) <= given, (route, string_fields(model) - given)


def test_poisoned_strings_get_a_400_naming_the_field_and_harm_no_one(text_server, capsys):
    s, fast = text_server
    beside = Beside(s)
    tried = served = 0
    try:
        for (method, path), (_, *bodies) in SAMPLES.items():
            for body, (where, kind) in [(b, leaf) for b in bodies for leaf in leaves(b)]:
                key = kind == "key"
                for poison in (SURROGATE, NUL, LONG):
                    r = s.http.request(method, path, json=None, content=json.dumps(poisoned(body, where, poison, key)),
                                       headers={"Content-Type": "application/json"})
                    tried += 1
                    field = name(where[0]) if key else name(where)
                    msg = r.json().get("error", {}).get("message", "") if r.status_code >= 400 else ""
                    if kind is True and poison != SURROGATE:   # prompt content: a NUL or a long text is text
                        assert r.status_code < 500 and "characters long" not in msg and "NUL" not in msg, \
                            (path, field, repr(poison)[:12], r.status_code, r.text[:300])
                        if poison == NUL and path in GENERATION:
                            assert r.status_code == 200, (path, field, r.text[:300])
                            served += 1
                        continue
                    assert r.status_code == 400, (path, field, repr(poison)[:12], r.status_code, r.text[:300])
                    assert (f"a key of {field or 'the body'}" if key else field) in msg, (path, field, msg)
                    assert SURROGATE not in msg and NUL not in msg and LONG not in msg
        for (method, path), hname in HEADERS.items():
            for bad in (b"\xed\xa0\x80", LONG.encode()):
                r = s.http.request(method, path, headers={hname: bad}, json=HEADER_BODIES[path])
                tried += 1
                assert r.status_code == 400 and f"header {hname}" in r.text, (path, r.text[:300])
        for (method, path), q in QUERIES.items():
            for bad in ("%00", LONG):   # a query's bytes that are not UTF-8 arrive as U+FFFD (yarl)
                r = s.http.request(method, f"{path}?{q}={bad}")
                tried += 1
                assert r.status_code == 400 and f"query parameter {q}" in r.text, (path, bad[:9], r.text[:300])
    finally:
        beside.stop()
    content = sum(kind is True for (_, p), (_, *bs) in SAMPLES.items() if p in GENERATION
                  for b in bs for _, kind in leaves(b))
    assert served == content >= 3, (served, content)   # the content cases reached the engine
    assert s.proc.poll() is None and s.http.get("/health").status_code == 200
    stats = s.stats()
    assert stats["num_running_reqs"] == 0 and stats["num_queue_reqs"] == 0
    with capsys.disabled():
        print(f"\n[client strings] {tried} poisoned requests, {served} content ones served, "
              f"{beside.runs} normal requests beside them all equal their baseline")


def test_a_nul_in_prompt_text_is_tokenized_as_text(text_server):
    s, fast = text_server
    text = "ab\x00ce d\x00"
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    by_text = s.http.post("/generate", json={"text": text, "sampling_params": sp}).json()
    by_ids = s.http.post("/generate", json={"input_ids": fast.encode(text), "sampling_params": sp}).json()
    assert fast.encode(text).count(fast.convert_tokens_to_ids("\x00")) == 2
    assert by_text["output_ids"] == by_ids["output_ids"] and by_text["meta_info"]["prompt_tokens"] == len(fast.encode(text))
