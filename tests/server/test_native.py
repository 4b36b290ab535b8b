"""SGLang native API against a real server, with request bodies shaped like the RL clients'."""
from __future__ import annotations

import concurrent.futures as cf
import time

from serverproc import start_stream

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


def _slime_payload(prompt_ids, max_new_tokens):
    # slime/rollout/sglang_rollout.py: GenerateState.sampling_params + generate()'s payload.
    sampling_params = dict(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens,
                           stop=None, stop_token_ids=None, skip_special_tokens=False, no_stop_trim=True,
                           spaces_between_special_tokens=False)
    return {"sampling_params": sampling_params, "return_logprob": True, "input_ids": prompt_ids}


def _areal_payload(input_ids, max_new_tokens, eos):
    # areal/engine/sglang_remote.py: RemoteSGLangEngine.agenerate() (GenerationHyperparameters
    # defaults: top_p 1.0, top_k int(1e8), temperature 1.0, frequency_penalty 0.0).
    sample_params = {"top_p": 1.0, "top_k": 100_000_000, "max_new_tokens": max_new_tokens,
                     "temperature": 1.0, "stop_token_ids": [eos], "frequency_penalty": 0.0}
    return {"input_ids": list(input_ids), "image_data": None, "sampling_params": sample_params,
            "return_logprob": True, "stream": False}


def test_slime_shaped_generate(server):
    r = server.http.post("/generate", json=_slime_payload(PROMPT, 6))
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    # What slime reads: text, output_token_logprobs as [logprob, token_id, text], finish_reason.
    assert out["text"] == ""
    toks = [x[1] for x in meta["output_token_logprobs"]]
    lps = [x[0] for x in meta["output_token_logprobs"]]
    assert toks == out["output_ids"] and 1 <= len(toks) <= 6
    assert all(x[2] is None for x in meta["output_token_logprobs"])
    assert all(lp <= 0.0 for lp in lps)
    assert meta["finish_reason"]["type"] in ("stop", "length")
    if meta["finish_reason"]["type"] == "length":
        assert len(toks) == 6
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == len(toks)
    assert meta["e2e_latency"] > 0 and isinstance(meta["id"], str)


def test_areal_shaped_generate_with_interruption(server):
    """AReaL's loop: on finish_reason abort it re-sends prompt + tokens so far. A pause in SGLang's
    default `abort` mode interrupts the request; after continue the resubmission completes."""
    eos = server.http.get("/get_model_info").json()["eos_token_ids"][0]
    total = 200
    payload = _areal_payload(PROMPT, total, eos)
    payload["sampling_params"]["stop_token_ids"] = []         # make the length deterministic
    payload["sampling_params"]["top_k"] = 100_000_000
    payload["sampling_params"]["temperature"] = 0.0
    reference = server.http.post("/generate", json=payload).json()

    tokens, logprobs, reasons = [], [], []
    with cf.ThreadPoolExecutor(1) as pool:
        first = pool.submit(server.http.post, "/generate", json=payload)
        running = server.wait_for(lambda s: s["num_running_reqs"] == 1, what="request running")
        # a few steps in, so the pause cuts a partial output
        server.wait_for(lambda s: s["step"] >= running["step"] + 3, what="request decoding")
        assert server.http.post("/pause_generation", json={}).json()["success"]
        res = first.result().json()
    assert server.http.post("/continue_generation").status_code == 200
    while True:
        meta = res["meta_info"]
        reasons.append(meta["finish_reason"]["type"])
        tokens += [x[1] for x in meta["output_token_logprobs"]]
        logprobs += [x[0] for x in meta["output_token_logprobs"]]
        if reasons[-1] != "abort":
            break
        payload["input_ids"] = list(PROMPT) + tokens
        payload["sampling_params"]["max_new_tokens"] = total - len(tokens)
        res = server.http.post("/generate", json=payload).json()
    assert reasons[0] == "abort" and reasons[-1] == "length", reasons
    assert len(tokens) == total
    # Greedy: the interrupted-and-resumed rollout equals the uninterrupted one token for token.
    assert tokens == reference["output_ids"]
    ref_lps = [x[0] for x in reference["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(logprobs, ref_lps)) < 1e-3


def test_batch_generate(server):
    r = server.http.post("/generate", json={
        "input_ids": [PROMPT, PROMPT[:3]], "rid": ["b-0", "b-1"],
        "sampling_params": [{"max_new_tokens": 2, "ignore_eos": True}, {"max_new_tokens": 4, "ignore_eos": True}]})
    assert r.status_code == 200, r.text
    a, b = r.json()
    assert (a["meta_info"]["id"], b["meta_info"]["id"]) == ("b-0", "b-1")
    assert (len(a["output_ids"]), len(b["output_ids"])) == (2, 4)
    assert "output_token_logprobs" not in a["meta_info"]


def test_stream_is_cumulative_and_matches_non_stream(server, sse):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
            "return_logprob": True}
    plain = server.http.post("/generate", json=body).json()
    with server.http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.iter_lines())
    assert len(events) >= 2
    lens = [len(e["output_ids"]) for e in events]
    assert lens == sorted(lens) and lens[-1] == 8                 # SGLang: cumulative output_ids
    for prev, cur in zip(events, events[1:]):
        assert cur["output_ids"][:len(prev["output_ids"])] == prev["output_ids"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    last = events[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert last["output_ids"] == plain["output_ids"]
    assert len(last["meta_info"]["output_token_logprobs"]) == 8


def test_abort_running_request_frees_kv(server, sse):
    body = {"input_ids": PROMPT, "rid": "to-abort", "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with server.http.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        first = next(x for x in lines if x)
        assert first.startswith("data: ")
        assert server.stats()["kv_blocks_used"] > 0
        a = server.http.post("/abort_request", json={"rid": "to-abort"})
        assert a.status_code == 200 and a.json()["aborted"] == 1
        events = sse(lines)
    last = events[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(last["output_ids"]) < 3000
    stats = server.wait_for(lambda s: s["num_running_reqs"] == 0, what="abort")
    assert stats["kv_blocks_used"] == 0 and stats["token_usage"] == 0.0
    # Aborting an unknown rid is not an error (SGLang), it just aborts nothing.
    assert server.http.post("/abort_request", json={"rid": "to-abort"}).json()["aborted"] == 0


def test_pause_in_place_keeps_request_and_kv(server):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    with cf.ThreadPoolExecutor(2) as pool:
        running = start_stream(pool, server.url, body)
        assert server.http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        paused = server.stats()
        time.sleep(0.3)
        still = server.stats()
        assert still["paused"] and still["step"] == paused["step"]      # no steps while paused
        assert still["kv_blocks_used"] > 0 and still["num_running_reqs"] == 1
        queued = pool.submit(server.http.post, "/generate", json={**body, "sampling_params": {"max_new_tokens": 2}})
        server.wait_for(lambda i: i["held"] == 1, what="new request held at the door", read=server.info)
        assert not queued.done() and server.stats()["num_queue_reqs"] == 0   # it waits for continue
        assert server.http.post("/continue_generation", json={}).status_code == 200
        out = running.result()
        assert queued.result().status_code == 200
    assert out["meta_info"]["finish_reason"]["type"] == "length" and out["meta_info"]["completion_tokens"] == 300


def test_flush_cache_health_and_info(server):
    assert server.http.post("/flush_cache").status_code == 200
    assert server.http.get("/health").json() == {"status": "ok"}
    before = server.stats()["step"]
    r = server.http.get("/health_generate")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert server.stats()["step"] > before                           # it really ran the engine
    info = server.http.get("/get_model_info").json()
    assert info["vocab_size"] == 512 and info["is_generation"] is True
    si = server.http.get("/get_server_info").json()
    assert si["mode"] == "pd" and si["port"] == int(server.url.rsplit(":", 1)[1])
    assert set(si["control"]) == {"activation", "span", "prefill_budget_tokens", "ordering", "p_wait_bound_ms",
                                "p_gather_ms", "p_burst_first"}
    # SGLang's server-args names, with this engine's values (slime's external-engine mode reads them)
    assert (si["tp_size"], si["dp_size"], si["ep_size"], si["pp_size"]) == (1, 1, 1, 1)
    assert si["enable_memory_saver"] is False and si["enable_return_routed_experts"] is True   # no --enable-memory-saver
    assert si["dtype"] == info["dtype"] and si["context_length"] == info["max_context_len"]
    assert si["max_total_num_tokens"] == si["internal_states"][0]["kv_blocks_total"] * si["page_size"]
    assert si["num_gpus"] == 0 and si["model_path"] == info["model_path"]


def test_priority_orders_admission(start_server):
    """SGLang's `priority` (higher first) reaches the planner: with one running row at a time,
    the batch's second prompt, at a higher priority, runs to its end before the first starts; the
    same batch at equal priorities runs in order."""
    srv = start_server("--engine-config", '{"max_running": 1}')
    sp = {"max_new_tokens": 6, "ignore_eos": True}
    for prios, first in (([0, 7], "p-1"), ([3, 3], "p-0")):
        r = srv.http.post("/generate", json={"input_ids": [PROMPT, PROMPT[:5]], "rid": ["p-0", "p-1"],
                                             "sampling_params": [sp, sp], "priority": prios})
        assert r.status_code == 200, r.text
        done = sorted(r.json(), key=lambda b: b["meta_info"]["e2e_latency"])
        assert done[0]["meta_info"]["id"] == first, (prios, [b["meta_info"] for b in done])
    r = srv.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "priority": "urgent"})
    assert r.status_code == 400 and "priority" in r.json()["error"]["message"]
    assert srv.stop() == 0


def test_router_fields_served_by_and_get_load(server):
    """What sglang-router sends and polls: its re-sent GenerateReqInput fields at their defaults, the
    older /get_load list beside /v1/loads; meta_info.served_by names this engine."""
    import socket
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True},
            "model": "tiny", "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False}
    r = server.http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["served_by"] == f"{socket.gethostname()}:{server.url.rsplit(':', 1)[1]}"
    old, new = server.http.get("/get_load").json(), server.http.get("/v1/loads").json()["loads"]
    assert [x["dp_rank"] for x in old] == [x["dp_rank"] for x in new]
    for o, n in zip(old, new):
        assert o["num_reqs"] == n["num_running_reqs"] + n["num_waiting_reqs"] == 0     # idle again
        assert o["num_tokens"] == n["num_total_tokens"] and isinstance(o["ts_tic"], float)
