"""Hostile clients against a real `pdrollout serve` (tiny model, CPU, loopback).

Property-based bodies for /generate, /v1/completions and /control; 1,000 concurrent
connections; slow clients; oversized bodies; clients that disconnect mid-stream. Throughout:
no response >= 500 and the server keeps serving (a greedy request answers the same tokens as
before). After each: no request running or queued, no KV block held, no request tracked, the
server's open sockets back to their count before, and RSS bounded. The counts tried print.
"""
from __future__ import annotations

import asyncio
import collections
import json
import os
import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st
from prometheus_client.parser import text_string_to_metric_families

from server.conftest import ServerProcess   # tests/ is on sys.path (pyproject)

pytestmark = pytest.mark.timeout(600)
BODY_LIMIT = 1 << 20          # the server's --max-body-bytes here: oversized bodies stay cheap to send
GREEDY = {"input_ids": [3, 1, 4, 1, 5], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0}}
LONG = {"input_ids": [2, 7, 1, 8], "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}


@pytest.fixture(scope="module")
def hostile(tiny_model):
    s = ServerProcess(tiny_model, "--max-body-bytes", str(BODY_LIMIT), "--rollout-idle", "0.5")
    s.tried = collections.Counter()
    s.baseline = s.http.post("/generate", json=GREEDY).json()["output_ids"]
    yield s
    assert s.stop() == 0, s.log[-5000:]


def report(capsys, text: str) -> None:
    with capsys.disabled():   # the counts show in CI output, not only on failure
        print(f"\n[hostile] {text}")


# ---- what "nothing leaked" means -------------------------------------------------------------
def rss_mib(s) -> float:
    with open(f"/proc/{s.proc.pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024


def sockets(s) -> int:
    fds = os.listdir(f"/proc/{s.proc.pid}/fd")
    return sum(1 for fd in fds if os.readlink(f"/proc/{s.proc.pid}/fd/{fd}").startswith("socket:"))


def aborted(s) -> float:
    for fam in text_string_to_metric_families(s.http.get("/metrics").text):
        for smp in fam.samples:
            if smp.name == "pdrollout:requests_total" and smp.labels == {"finish_reason": "abort"}:
                return smp.value
    return 0.0


def finished(s) -> float:
    return sum(smp.value for fam in text_string_to_metric_families(s.http.get("/metrics").text)
               for smp in fam.samples if smp.name == "pdrollout:requests_total")


def assert_idle(s, sockets_before: int | None = None, timeout: float = 30) -> dict:
    """Back to idle: nothing running, queued, holding KV or tracked; rollouts closed; the
    server's sockets back to `sockets_before` (+1: the test's own keep-alive connection)."""
    deadline = time.monotonic() + timeout
    while True:
        info = s.http.get("/get_server_info").json()
        st_ = info["internal_states"][0]
        rollouts = s.http.get("/rollouts").json()["active"]
        now = sockets(s)
        idle = (st_["num_running_reqs"] == 0 and st_["num_queue_reqs"] == 0 and st_["kv_blocks_used"] == 0
                and info["in_flight"] == 0 and rollouts == 0
                and (sockets_before is None or now <= sockets_before + 1))
        if idle:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout}s: {st_}, in_flight {info['in_flight']}, "
                                 f"rollouts {rollouts}, sockets {now} (before {sockets_before})")
        time.sleep(0.05)


def assert_serving(s) -> None:
    assert s.http.get("/health").json() == {"status": "ok"}
    assert s.http.post("/generate", json=GREEDY).json()["output_ids"] == s.baseline


# ---- property-based bodies ---------------------------------------------------------------------
# A valid body, then 0..2 mutations: a field set to a hostile value, a field dropped, or a key
# nobody defined. So the fuzz reaches the engine (valid bodies run) and every validation path.
scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=12))
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                           max_leaves=12)
edges = st.sampled_from([0, -1, 1, 2 ** 63, -2 ** 63 - 1, 2 ** 64, 10 ** 30, 1e-40, 5e-324, 1e308, float("nan"),
                         float("inf"), -0.0, "", "0", "auto", [], {}, [[]], None, True])
hostile_value = st.one_of(json_values, edges)

token = st.integers(0, 511)
prompt = st.lists(token, min_size=1, max_size=6)
sampling = st.fixed_dictionaries(
    {"max_new_tokens": st.integers(1, 6)},
    optional={"temperature": st.one_of(st.just(0.0), st.floats(0.05, 2.0), st.just(1e-40)),
              "top_p": st.floats(0.01, 1.0), "top_k": st.one_of(st.just(-1), st.integers(1, 600)),
              "seed": st.one_of(st.integers(-2 ** 63, 2 ** 64 - 1), st.sampled_from([-2 ** 63, 2 ** 64 - 1])),
              "ignore_eos": st.booleans(), "stop_token_ids": st.lists(token, max_size=3),
              "min_new_tokens": st.integers(0, 1), "skip_special_tokens": st.booleans(),
              "frequency_penalty": st.just(0.0), "custom_params": st.none()})
generate_valid = st.one_of(
    st.fixed_dictionaries({"input_ids": prompt, "sampling_params": sampling},
                          optional={"stream": st.booleans(), "return_logprob": st.booleans(),
                                    "rid": st.uuids().map(str), "rollout_id": st.text(min_size=1, max_size=6),
                                    "log_metrics": st.booleans(), "top_logprobs_num": st.just(0)}),
    st.integers(1, 3).flatmap(lambda n: st.fixed_dictionaries(
        {"input_ids": st.lists(prompt, min_size=n, max_size=n),
         "sampling_params": st.one_of(sampling, st.lists(sampling, min_size=n, max_size=n))},
        optional={"stream": st.booleans(), "return_logprob": st.booleans()})))
completion_valid = st.fixed_dictionaries(
    {"prompt": st.one_of(prompt, st.lists(prompt, min_size=1, max_size=3)), "max_tokens": st.integers(1, 6)},
    optional={"temperature": st.one_of(st.just(0.0), st.floats(0.05, 2.0)), "top_p": st.floats(0.01, 1.0),
              "top_k": st.integers(1, 600), "stream": st.booleans(), "logprobs": st.integers(0, 5),
              "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
              "ignore_eos": st.booleans(), "seed": st.integers(0, 2 ** 32), "stop_token_ids": st.lists(token, max_size=2),
              "n": st.just(1), "echo": st.just(False), "rollout_id": st.text(min_size=1, max_size=6)})
control_valid = st.fixed_dictionaries({}, optional={
    "ordering": st.sampled_from(["fine-grained", "global-enqueue", "global-complete", "normal", "isolation-only"]),
    "activation": st.sampled_from(["on", "off", "auto"]), "span": st.one_of(st.integers(1, 4), st.just("auto")),
    "prefill_budget_tokens": st.integers(1, 10 ** 6)})

GENERATE_PATHS = ["input_ids", "sampling_params", "stream", "return_logprob", "rid", "rollout_id", "text",
                  "image_data", "lora_path", "logprob_start_len", "top_logprobs_num", "return_hidden_states",
                  "sampling_params.max_new_tokens", "sampling_params.temperature", "sampling_params.top_p",
                  "sampling_params.top_k", "sampling_params.seed", "sampling_params.min_new_tokens",
                  "sampling_params.stop_token_ids", "sampling_params.ignore_eos", "sampling_params.stop",
                  "sampling_params.custom_params", "sampling_params.regex", "input_ids.0"]
COMPLETION_PATHS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "stream", "stream_options",
                    "logprobs", "n", "echo", "best_of", "logit_bias", "suffix", "model", "seed", "stop",
                    "stop_token_ids", "min_tokens", "prompt.0", "stream_options.include_usage"]
CONTROL_PATHS = ["ordering", "activation", "span", "prefill_budget_tokens"]


def mutate(body, mutations):
    body = json.loads(json.dumps(body))
    for path, how, value in mutations:
        *parents, last = path.split(".")
        node = body
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else (node[0] if isinstance(node, list) and node else None)
        if isinstance(node, list) and last.isdigit():
            if node:
                node[0] = value
        elif isinstance(node, dict):
            if how == "drop":
                node.pop(last, None)
            else:
                node[last] = value
    return body


def mutated(valid, paths):
    mutation = st.tuples(st.sampled_from(paths + ["an unknown key"]), st.sampled_from(["set", "set", "drop"]),
                         hostile_value)
    return st.tuples(valid, st.lists(mutation, max_size=2)).map(lambda t: mutate(*t))


generate_body = mutated(generate_valid, GENERATE_PATHS)
completion_body = mutated(completion_valid, COMPLETION_PATHS)
control_body = mutated(control_valid, CONTROL_PATHS)
raw_body = st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode),
                     json_values.map(lambda v: json.dumps(v).encode()),
                     generate_body.map(lambda v: json.dumps(v).encode()[:-3]))   # truncated JSON


def send(s, method: str, path: str, body: bytes) -> int:
    """One request; a stream is read to its end. Returns the status after checking the shape
    of what came back."""
    headers = {"content-type": "application/json"}
    with s.http.stream(method, path, content=body, headers=headers, timeout=60) as r:
        data = r.read()
    s.tried[(path, r.status_code // 100)] += 1
    assert r.status_code < 500, (path, body[:500], r.status_code, data[:500])
    if r.status_code >= 400:
        assert "error" in json.loads(data), data[:300]
    return r.status_code


def fuzz(n: int) -> settings:
    return settings(max_examples=n, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
ENDPOINTS = [("POST", "/generate"), ("POST", "/v1/completions"), ("PUT", "/control")]


def test_fuzzed_bodies_get_no_5xx_and_leave_nothing(hostile, capsys):
    rss_start = rss_mib(hostile)

    # the bodies that once took the server down, always tried (engine step failed / 500)
    @fuzz(600)
    @example({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "temperature": float("nan")}})
    @example({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "temperature": 1e-40}})
    @example({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "temperature": 5e-324, "top_k": 3}})
    @example({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "top_p": float("nan"),
                                                       "temperature": float("inf")}})
    @example({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "seed": 2 ** 70}})
    @example({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}, "rollout_id": "one-step"})
    @given(generate_body)
    def generate(body):
        send(hostile, "POST", "/generate", json.dumps(body).encode())

    @fuzz(350)
    @example({"prompt": [1, 2], "max_tokens": 2, "temperature": float("nan")})
    @example({"prompt": [1, 2], "max_tokens": 2, "seed": -2 ** 64})
    @given(completion_body)
    def completions(body):
        send(hostile, "POST", "/v1/completions", json.dumps(body).encode())

    @fuzz(200)
    @given(control_body)
    def control(body):
        send(hostile, "PUT", "/control", json.dumps(body).encode())

    @fuzz(200)
    @example(("POST", "/generate"), b'{"input_ids": ' + b"[" * 100000 + b"]" * 100000 + b"}")
    @example(("PUT", "/control"), b'{"a": ' * 50000 + b"1" + b"}" * 50000)
    @given(st.sampled_from(ENDPOINTS), raw_body)
    def raw(endpoint, body):
        send(hostile, *endpoint, body)

    t0 = time.monotonic()
    for run in (generate, completions, control, raw):
        run()
    dt = time.monotonic() - t0
    hostile.http.put("/control", json={"ordering": "fine-grained", "activation": "auto", "span": "auto",
                                       "prefill_budget_tokens": 32768})
    assert_serving(hostile)
    assert_idle(hostile)
    tried = sum(hostile.tried.values())
    by = collections.defaultdict(dict)
    for (path, klass), n in sorted(hostile.tried.items()):
        by[path][f"{klass}xx"] = n
    report(capsys, f"fuzz: {tried} bodies in {dt:.0f} s, responses by class {dict(by)}; none >= 500; "
                   f"RSS {rss_start:.0f} -> {rss_mib(hostile):.0f} MiB")
    # every endpoint both accepted and refused some bodies: the fuzz reached past validation
    for path in ("/generate", "/v1/completions", "/control"):
        assert by[path].get("2xx") and by[path].get("4xx"), by


def test_memory_bounded_over_many_requests(hostile, capsys):
    """A second equal round of requests must not grow the process beyond noise (10 % of its
    size: allocator and torch caches): nothing accumulates per request."""
    bodies = [json.dumps({"input_ids": [i % 500 + 2, 5], "sampling_params": {"max_new_tokens": 3},
                          "rid": f"mem-{k}-{i}", "rollout_id": f"r{i % 7}", "return_logprob": bool(i % 2),
                          "stream": i % 3 == 0}).encode()
              for k in range(3) for i in range(300)]
    marks = [rss_mib(hostile)]
    for k in range(3):
        for b in bodies[k * 300:(k + 1) * 300]:
            assert send(hostile, "POST", "/generate", b) == 200
        marks.append(rss_mib(hostile))
    report(capsys, "RSS over 3 x 300 requests: " + " -> ".join(f"{m:.0f}" for m in marks) + " MiB")
    assert marks[3] - marks[1] < 0.1 * marks[1]
    assert_idle(hostile)


def rollouts_finished(s) -> float:
    for fam in text_string_to_metric_families(s.http.get("/metrics").text):
        for smp in fam.samples:
            if smp.name == "pdrollout:rollouts_finished_total":
                return smp.value
    return 0.0


def test_requests_done_in_one_step_close_their_rollouts(hostile):
    """A request that finished within the engine's first step was dispatched before its handler
    counted it in its rollout, which then stayed in flight forever (found by the fuzz)."""
    before = rollouts_finished(hostile)
    for i in range(30):
        r = hostile.http.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1},
                                                 "rollout_id": f"one-step-{i}"})
        assert r.status_code == 200
    assert_idle(hostile)   # rollouts active back to 0 once idle for --rollout-idle
    assert rollouts_finished(hostile) - before == 30


# ---- load ------------------------------------------------------------------------------------
async def _hold_and_ask(host: str, port: int, n: int) -> collections.Counter:
    """Opens n connections first (all held at once), then sends a request on each."""
    conns = await asyncio.gather(*(asyncio.open_connection(host, port) for _ in range(n)))
    kinds = []
    for i, (_, w) in enumerate(conns):
        if i % 3 == 0:
            body, path = json.dumps({"input_ids": [i % 500 + 2], "sampling_params": {"max_new_tokens": 2}}), "/generate"
        elif i % 3 == 1:
            body, path = json.dumps({"prompt": [i % 500 + 2, 9], "max_tokens": 2}), "/v1/completions"
        else:
            body, path = "", "/health"
        method = "GET" if path == "/health" else "POST"
        w.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        kinds.append(path)

    async def answer(r, w):
        data = await asyncio.wait_for(r.read(), 120)
        w.close()
        return int(data.split(b" ", 2)[1])

    codes = await asyncio.gather(*(answer(r, w) for r, w in conns))
    return collections.Counter(zip(kinds, codes))


def test_1000_concurrent_connections(hostile, capsys):
    host, port = hostile.url.removeprefix("http://").split(":")
    before_sockets, served_before = sockets(hostile), finished(hostile)
    t0 = time.monotonic()
    got = asyncio.run(_hold_and_ask(host, int(port), 1000))
    dt = time.monotonic() - t0
    report(capsys, f"1000 concurrent connections in {dt:.1f} s: {dict(got)}")
    assert sum(got.values()) == 1000 and all(code == 200 for _, code in got)
    assert finished(hostile) - served_before == sum(n for (path, _), n in got.items() if path != "/health")
    assert_serving(hostile)
    assert_idle(hostile, before_sockets)


# ---- slow clients ------------------------------------------------------------------------------
def test_slow_clients_do_not_stall_others_and_leave_nothing(hostile, capsys):
    host, port = hostile.url.removeprefix("http://").split(":")
    before_sockets, served_before = sockets(hostile), finished(hostile)
    slow: list[socket.socket] = []
    body = json.dumps(GREEDY).encode()
    for i in range(120):
        c = socket.create_connection((host, int(port)))
        if i % 3 == 0:     # slowloris: headers that never end
            c.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
        elif i % 3 == 1:   # a body shorter than its Content-Length
            c.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:10])
        else:              # a chunked body that stops mid-way
            c.sendall(b"PUT /control HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"spa")
        slow.append(c)
    # a slow reader: a long stream it never reads (the socket buffers fill, the server waits)
    reader = socket.create_connection((host, int(port)))
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sbody = json.dumps({**LONG, "stream": True, "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}})
    reader.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(sbody) + sbody.encode())
    latencies = []
    for _ in range(6):
        for c in slow[::3]:   # the slowloris ones keep dribbling header lines
            c.sendall(b"X-Slow: 1\r\n")
        t0 = time.monotonic()
        assert_serving(hostile)
        latencies.append(time.monotonic() - t0)
        time.sleep(0.2)
    report(capsys, f"slow clients: 120 partial requests + 1 stalled reader held; 6 normal requests served "
                   f"meanwhile in max {max(latencies) * 1000:.0f} ms")
    # the 6 probes finished (and perhaps the stalled reader's request): none of the partial ones ran
    assert 6 <= finished(hostile) - served_before <= 7
    for c in slow:
        c.close()
    reader.close()
    assert_idle(hostile, before_sockets)


# ---- oversized bodies --------------------------------------------------------------------------
@pytest.mark.parametrize("method,path", [("POST", "/generate"), ("POST", "/v1/completions"), ("PUT", "/control")])
def test_oversized_bodies(hostile, capsys, method, path):
    host, port = hostile.url.removeprefix("http://").split(":")
    before_sockets, rss_before = sockets(hostile), rss_mib(hostile)
    # a Content-Length past the limit is refused from the headers: the body is never sent
    with socket.create_connection((host, int(port))) as c:
        c.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {10 ** 10}\r\n\r\n".encode())
        head = c.recv(65536)
        assert head.startswith(b"HTTP/1.1 413"), head[:200]
    # a chunked body 16x the limit: refused once past the limit, never buffered whole
    chunk = b" " * 65536

    def chunks():
        yield b"{"
        for _ in range(16 * BODY_LIMIT // len(chunk)):
            yield chunk
    sent = 0
    try:
        r = hostile.http.request(method, path, content=chunks(), headers={"content-type": "application/json"})
        sent = r.status_code
        assert r.status_code == 413 and "limit" in r.json()["error"]["message"], r.text[:300]
    except (httpx.RemoteProtocolError, httpx.WriteError):
        sent = "closed"    # the server answered 413 and closed while the client still wrote
    # a gzip bomb: 64 MiB of JSON whitespace in ~64 KiB; decompressed past the limit -> 413
    import gzip
    bomb = gzip.compress(b"{" + b" " * (64 << 20) + b"}", compresslevel=9)
    r = hostile.http.request(method, path, content=bomb, headers={"content-type": "application/json",
                                                                   "content-encoding": "gzip"})
    assert r.status_code == 413, (r.status_code, r.text[:300])
    # exactly at the limit is not "too large"
    pad = b" " * (BODY_LIMIT - 2)
    r = hostile.http.request(method, path, content=b"{" + pad + b"}", headers={"content-type": "application/json"})
    assert r.status_code != 413 and r.status_code < 500
    rss_after = rss_mib(hostile)
    report(capsys, f"{method} {path}: Content-Length 10 GB -> 413; chunked 16 MiB -> {sent}; "
                   f"gzip bomb {len(bomb) >> 10} KiB -> 64 MiB -> 413; "
                   f"{BODY_LIMIT} bytes -> {r.status_code}; RSS {rss_before:.0f} -> {rss_after:.0f} MiB")
    assert rss_after - rss_before < 16 * BODY_LIMIT / 2 ** 20   # neither 16 MiB nor 64 MiB was held
    assert_serving(hostile)
    assert_idle(hostile, before_sockets)


# ---- disconnects -------------------------------------------------------------------------------
async def _stream_then_vanish(url: str, path: str, body: dict) -> bool:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return True   # a token came: leave mid-stream
    return False


async def _send_unanswered(host: str, port: int, body: dict) -> asyncio.StreamWriter:
    """A non-streaming request sent; its connection, to be closed before the answer comes."""
    _, w = await asyncio.open_connection(host, port)
    data = json.dumps(body).encode()
    w.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    await w.drain()
    return w


async def _vanish(w: asyncio.StreamWriter) -> None:
    w.close()


def test_clients_that_disconnect_mid_stream_leave_nothing(hostile, capsys):
    host, port = hostile.url.removeprefix("http://").split(":")
    before_sockets, aborted_before = sockets(hostile), aborted(hostile)
    n = 16

    async def main():
        streams = [_stream_then_vanish(hostile.url, "/generate", {**LONG, "stream": True, "rid": f"s{i}"})
                   for i in range(n)]
        streams += [_stream_then_vanish(hostile.url, "/v1/completions",
                                        {"prompt": [[2, 7], [1, 8]], "max_tokens": 3000, "ignore_eos": True,
                                         "stream": True}) for _ in range(n)]
        # the quiet ones first, each in flight on the server (the server is idle before), then all leave
        quiet = await asyncio.gather(*[_send_unanswered(host, int(port), {**LONG, "rid": f"q{i}"}) for i in range(n)])
        await asyncio.to_thread(hostile.wait_for, lambda i: i["in_flight"] == n, what="quiet requests in flight",
                                read=hostile.info)
        return await asyncio.gather(*streams, *[_vanish(w) for w in quiet])

    got = asyncio.run(main())
    assert all(got[:2 * n])
    assert_idle(hostile, before_sockets)
    gone = aborted(hostile) - aborted_before
    # each completions stream carried a batch of two prompts
    report(capsys, f"disconnects: {n} /generate streams, {n} /v1/completions streams (2 prompts each) and "
                   f"{n} non-streaming requests left early; {gone:.0f} requests aborted, KV and tracking idle")
    assert gone == n + 2 * n + n
    assert_serving(hostile)
