"""Bad input gets a 4xx with a message, and the server keeps serving."""
from __future__ import annotations

import pytest

OK = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


@pytest.mark.parametrize("raw, status, needle", [
    (b'{"input_ids": [1, 2', 400, "malformed JSON"),
    (b"\xff\xfe", 400, "malformed JSON"),
    (b"[1, 2, 3]", 400, "JSON object"),
    (b"", 400, "empty"),
])
def test_malformed_bodies(server, raw, status, needle):
    r = server.http.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status and needle in r.json()["error"]["message"]


@pytest.mark.parametrize("body, needle", [
    ({"input_ids": "1 2 3"}, "input_ids"),
    ({"input_ids": [1, "2"]}, "input_ids"),
    ({"input_ids": [1, 2.5]}, "input_ids"),
    ({"input_ids": []}, "empty"),
    ({"input_ids": [1, 2], "stream": "yes"}, "stream"),
    ({"input_ids": [1, 2], "bogus": 1}, "bogus"),
    ({"input_ids": [1, 2], "image_data": "http://x/img.png"}, "image_data"),
    ({"sampling_params": {"max_new_tokens": 2}}, "input_ids or text"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "typo_param": 1}}, "typo_param"),
    ({"input_ids": [1, 999999]}, "vocabulary"),
    ({"input_ids": [[1, 2], [3]], "sampling_params": [{}]}, "sampling_params"),
    ({"input_ids": [[1, 2], [3, 999999]]}, "input 1"),
    ({"text": "hello"}, "tokenizer"),
    ({"input_ids": [1, 2], "priority": "high"}, "priority"),
    ({"input_ids": [1, 2], "priority": 1.5}, "priority"),
    ({"input_ids": [1, 2], "priority": True}, "priority"),
    ({"input_ids": [1, 2], "priority": 2**31}, "priority must be an integer in"),
    ({"input_ids": [[1, 2], [3]], "priority": [1]}, "priority is a list of 1"),
    ({"input_ids": [1, 2], "background": True}, "background"),          # sglang-router's fields: defaults only
    ({"input_ids": [1, 2], "return_entropy": True}, "return_entropy"),
])
def test_invalid_generate_requests(server, body, needle):
    r = server.http.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()


def test_rejected_batch_leaves_nothing_running(server):
    r = server.http.post("/generate", json={"input_ids": [[1, 2], [3, 999999]], "rid": ["keep-a", "keep-b"]})
    assert r.status_code == 400
    s = server.wait_for(lambda s: s["num_running_reqs"] + s["num_queue_reqs"] == 0, what="idle")
    assert s["kv_blocks_used"] == 0
    assert server.http.post("/generate", json={**OK, "rid": "keep-a"}).status_code == 200


def test_duplicate_running_rid(server):
    import concurrent.futures as cf
    body = {"input_ids": [1, 2, 3], "rid": "dup", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    with cf.ThreadPoolExecutor(1) as pool:
        first = pool.submit(server.http.post, "/generate", json=body)
        server.wait_for(lambda s: s["num_running_reqs"] == 1, what="running")
        r = server.http.post("/generate", json=body)
        assert r.status_code == 400 and "already running" in r.json()["error"]["message"]
        server.http.post("/abort_request", json={"rid": "dup"})
        assert first.result().json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_body_over_the_size_limit(server):
    big = b'{"input_ids": [' + b"1, " * (12 << 20) + b"1]}"      # ~36 MiB > the 32 MiB default
    r = server.http.post("/generate", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_other_endpoints_validate(server):
    assert server.http.post("/abort_request", json={}).status_code == 400
    assert server.http.post("/abort_request", json={"rid": 5}).status_code == 400
    assert server.http.post("/pause_generation", json={"mode": "forever"}).status_code == 400
    assert server.http.post("/rollout/finish", json={"rollout": "x"}).status_code == 400
    r = server.http.get("/generate")
    assert r.status_code == 405 and "error" in r.json()
    r = server.http.get("/no/such/path")
    assert r.status_code == 404 and "error" in r.json()


def test_still_serving_after_bad_input(server):
    assert server.http.get("/health").json() == {"status": "ok"}
    r = server.http.post("/generate", json=OK)
    assert r.status_code == 200 and len(r.json()["output_ids"]) >= 1
