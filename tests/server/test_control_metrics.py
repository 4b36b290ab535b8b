"""/control (live, validated as a whole), /metrics (parsed by prometheus-client) and rollout makespan."""
from __future__ import annotations

import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

DEFAULT = {"activation": "auto", "span": "auto", "prefill_budget_tokens": 32768, "ordering": "fine-grained",
           "p_wait_bound_ms": None, "p_gather_ms": None, "p_burst_first": None}
BODY = {"input_ids": [5, 6, 7, 8, 9], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}


def _metrics(server) -> dict:
    r = server.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


@pytest.fixture
def restore_control(server):
    yield
    assert server.http.put("/control", json=DEFAULT).status_code == 200


def test_control_changes_apply_live(server, restore_control):
    assert server.http.get("/control").json() == DEFAULT
    r = server.http.put("/control", json={"span": 2, "ordering": "global-enqueue"})
    assert r.status_code == 200
    want = {**DEFAULT, "span": 2, "ordering": "global-enqueue"}
    assert r.json() == want and server.http.get("/control").json() == want
    # It reaches the planner at the next step boundary: the next steps run with span 2.
    assert server.http.post("/generate", json=BODY).status_code == 200
    assert _metrics(server)["pdrollout:segment_span"] == 2
    r = server.http.put("/control", json={"activation": "off", "span": "auto", "prefill_budget_tokens": 4096,
                                          "p_wait_bound_ms": 250})
    assert r.json() == {"activation": "off", "span": "auto", "prefill_budget_tokens": 4096,
                        "ordering": "global-enqueue", "p_wait_bound_ms": 250, "p_gather_ms": None,
                        "p_burst_first": None}


@pytest.mark.parametrize("bad, needle", [
    ({"span": 5}, "span"), ({"span": 0}, "span"), ({"span": "2"}, "span"), ({"activation": "sometimes"}, "activation"),
    ({"ordering": "random"}, "ordering"), ({"prefill_budget_tokens": 0}, "prefill_budget_tokens"),
    ({"span": 2, "bogus": 1}, "bogus"), ({"p_wait_bound_ms": 0}, "p_wait_bound_ms"),
    ({"p_wait_bound_ms": "soon"}, "p_wait_bound_ms"), ({"p_gather_ms": -5}, "p_gather_ms"),
])
def test_invalid_control_is_rejected_and_changes_nothing(server, restore_control, bad, needle):
    before = server.http.get("/control").json()
    r = server.http.put("/control", json=bad)
    assert r.status_code == 400 and needle in r.json()["error"]["message"]
    assert server.http.get("/control").json() == before


def test_invalid_control_bodies(server):
    for raw in (b"{not json", b"[1, 2]", b""):
        r = server.http.put("/control", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, raw
    assert server.http.get("/control").json() == DEFAULT


CONTRACT = {
    "gauge": ["num_running_reqs", "num_queue_reqs", "token_usage", "multiplexing_active", "segment_span",
              "rollout_makespan_seconds"],
    "histogram": ["time_to_first_token_seconds", "e2e_request_latency_seconds", "decode_wait_seconds", "decode_step_seconds",
                  "decode_step_beside_p_seconds",
                  "p_epoch_seconds", "p_epoch_enqueue_seconds", "p_epoch_cpu_seconds",
                  "turnstile_rendezvous_seconds", "rollout_makespan_seconds_hist"],
    "counter": ["prompt_tokens", "generation_tokens", "turnstile_rounds", "stalls", "rollouts_finished", "jit_compiles"],
}


def test_metrics_families_and_counters_move(server):
    r = server.http.get("/metrics")
    families = {f.name: f.type for f in text_string_to_metric_families(r.text)}
    for kind, names in CONTRACT.items():
        for n in names:
            assert families.get("pdrollout:" + n) == kind, (n, families.get("pdrollout:" + n))
    before = _metrics(server)
    out = server.http.post("/generate", json=BODY).json()
    after = _metrics(server)
    assert after["pdrollout:prompt_tokens_total"] - before["pdrollout:prompt_tokens_total"] == 5
    assert after["pdrollout:generation_tokens_total"] - before["pdrollout:generation_tokens_total"] == 4
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert after[f"pdrollout:{h}_count"] == before[f"pdrollout:{h}_count"] + 1
    # One decode wait per decode row: 3 decode steps after the prefill step sampled token 1.
    assert after["pdrollout:decode_wait_seconds_count"] - before["pdrollout:decode_wait_seconds_count"] == 3
    # ... and those 3 steps are the decode-only ones, each a wall time > 0
    assert after["pdrollout:decode_step_seconds_count"] - before["pdrollout:decode_step_seconds_count"] == 3
    assert after["pdrollout:decode_step_seconds_sum"] > before["pdrollout:decode_step_seconds_sum"]
    # no P epoch ran beside them (this server fuses P into its steps)
    assert after["pdrollout:decode_step_beside_p_seconds_count"] == before["pdrollout:decode_step_beside_p_seconds_count"]
    assert after["pdrollout:requests_total{finish_reason=length}"] == \
        before.get("pdrollout:requests_total{finish_reason=length}", 0) + 1
    e2e = after["pdrollout:e2e_request_latency_seconds_sum"] - before["pdrollout:e2e_request_latency_seconds_sum"]
    assert e2e == pytest.approx(out["meta_info"]["e2e_latency"], abs=0.05)
    assert after["pdrollout:num_running_reqs"] == 0 and after["pdrollout:token_usage"] == 0


def test_rollout_makespan(server):
    before = _metrics(server)
    t0 = time.monotonic()
    a = server.http.post("/generate", json={**BODY, "rollout_id": "step-7"})
    b = server.http.post("/generate", json=BODY, headers={"X-Rollout-Id": "step-7"})
    elapsed = time.monotonic() - t0
    assert a.status_code == b.status_code == 200
    r = server.http.post("/rollout/finish", json={"rollout_id": "step-7"})
    summary = r.json()
    assert r.status_code == 200 and summary["finished"] and summary["num_requests"] == 2
    assert 0 < summary["makespan_s"] <= elapsed
    assert summary["makespan_s"] >= a.json()["meta_info"]["e2e_latency"] + b.json()["meta_info"]["e2e_latency"] - 0.01
    after = _metrics(server)
    assert after["pdrollout:rollouts_finished_total"] == before["pdrollout:rollouts_finished_total"] + 1
    assert after["pdrollout:rollout_makespan_seconds"] == pytest.approx(summary["makespan_s"])
    assert after["pdrollout:rollout_requests"] == 2
    assert server.http.post("/rollout/finish", json={"rollout_id": "never-seen"}).status_code == 404


def test_rollout_finishes_when_idle(server):
    before = _metrics(server)["pdrollout:rollouts_finished_total"]
    assert server.http.post("/generate", json={**BODY, "rollout_id": "idle-one"}).status_code == 200
    deadline = time.monotonic() + 15          # rollout_idle_s defaults to 5 s
    while _metrics(server)["pdrollout:rollouts_finished_total"] == before:
        assert time.monotonic() < deadline, "idle rollout never finished"
        time.sleep(0.2)
    recent = server.http.get("/rollouts").json()["recent"]
    assert recent[-1]["rollout_id"] == "idle-one" and recent[-1]["num_requests"] == 1


def test_speculation_in_meta_info_metrics_and_model_info(start_server):
    """`serve --speculative ngram`: each response's meta_info carries SGLang's spec_* keys, and the
    /metrics counters move by exactly what the responses report."""
    s = start_server("--speculative", "ngram", "--speculative-k", "3")
    assert s.http.get("/get_model_info").json()["speculative"] == "ngram"
    before = _metrics(s)
    body = {"input_ids": [5, 6, 7, 5, 6, 7, 5, 6], "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                        "ignore_eos": True}}
    meta = s.http.post("/generate", json=body).json()["meta_info"]
    after = _metrics(s)
    assert meta["completion_tokens"] == 8
    assert meta["spec_verify_ct"] + meta["spec_accepted_drafts"] == 7      # the first token came from P
    assert meta["spec_proposed_drafts"] > 0                                # the prompt's suffix recurs
    # the names slime and AReaL read (SGLang's older meta_info keys), the same counts
    assert (meta["spec_accept_token_num"], meta["spec_draft_token_num"]) == \
        (meta["spec_accepted_drafts"], meta["spec_proposed_drafts"])
    assert meta["spec_accept_length"] == pytest.approx(7 / meta["spec_verify_ct"])
    for name, key in (("spec_verify_total", "spec_verify_ct"), ("spec_proposed_drafts_total", "spec_proposed_drafts"),
                      ("spec_accepted_drafts_total", "spec_accepted_drafts")):
        assert after["pdrollout:" + name] - before.get("pdrollout:" + name, 0) == meta[key], name
    assert s.stop() == 0, s.log


def test_p_epochs_beside_d_are_counted_and_timed(server, start_server):
    """pd on one rank with solo_overlap (on by default on CUDA; asked for here on CPU): a prompt that
    arrives while another request decodes runs as a P epoch beside D, and /metrics times it (wall,
    issuing, the P thread's CPU time). The shared server runs no epochs: its counts stay put."""
    before = _metrics(server)
    assert server.http.post("/generate", json=BODY).status_code == 200
    assert _metrics(server)["pdrollout:p_epoch_seconds_count"] == before["pdrollout:p_epoch_seconds_count"] == 0
    srv = start_server("--engine-config", json.dumps(
        {"solo_overlap": True, "control": {"activation": "on", "p_burst_first": False}}))
    long = {"input_ids": [3, 4, 5, 6], "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    with srv.http.stream("POST", "/generate", json=long) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))   # it decodes now
        for i in range(3):   # each prompt's P runs beside the long request's D steps
            out = srv.http.post("/generate", json={"input_ids": [7 + i, 8, 9, 10, 11, 12],
                                                   "sampling_params": {"max_new_tokens": 2}})
            assert out.status_code == 200, out.text
        running = _metrics(srv)
        for _ in lines:
            pass
    assert running["pdrollout:num_running_reqs"] == 1   # the long one was still decoding
    n = running["pdrollout:p_epoch_seconds_count"]
    assert n >= 3, running
    assert running["pdrollout:p_epoch_enqueue_seconds_count"] == running["pdrollout:p_epoch_cpu_seconds_count"] == n
    wall, issue = running["pdrollout:p_epoch_seconds_sum"], running["pdrollout:p_epoch_enqueue_seconds_sum"]
    cpu = running["pdrollout:p_epoch_cpu_seconds_sum"]
    assert wall >= issue and issue + 1e-3 * n >= cpu > 0, running   # one thread's CPU time fits its wall time
    beside = running["pdrollout:decode_step_beside_p_seconds_count"]
    assert beside <= running["pdrollout:decode_step_seconds_count"], running   # a subset of the D-only steps
    assert srv.stop() == 0, srv.log


def test_a_held_burst_is_served_the_engine_waking_for_it(start_server):
    """p_idle_gather_ms: the bridge sleeps while the planner holds arrivals and wakes for new ones or
    the hold's end (a lost wake-up would leave these requests waiting forever)."""
    from concurrent.futures import ThreadPoolExecutor
    srv = start_server("--engine-config", json.dumps({"p_idle_gather_ms": 100.0}))
    assert srv.http.post("/generate", json=BODY, timeout=30).status_code == 200   # a lone arrival
    body = lambda i: {"input_ids": [5 + i, 6, 7, 8], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda i: srv.http.post("/generate", json=body(i), timeout=30), range(4)))
    assert [r.status_code for r in replies] == [200] * 4
    assert all(r.json()["meta_info"]["completion_tokens"] == 3 for r in replies)
