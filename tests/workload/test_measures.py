"""Bench measures on hand-made records (pure functions)."""
import pytest

from pdrollout.engine.workload.measures import (BenchError, RequestRecord, check_same_work,
                                                format_table, metric_sums, server_measures,
                                                summarize)


def rec(sid, turn, release, first, done, wait_start=None, pin=10, pout=5, cached=0, by=None):
    return RequestRecord(session_id=sid, turn=turn, wait_start_s=wait_start, release_s=release,
                         first_token_s=first, done_s=done, prompt_tokens=pin,
                         completion_tokens=pout, cached_tokens=cached, served_by=by)


RECORDS = [
    rec("a", 0, 1.0, 1.1, 2.0),
    rec("a", 1, 2.5, 2.7, 4.0, wait_start=2.0, pin=20, cached=15),
    rec("b", 0, 1.0, 1.4, 1.5),
    rec("b", 1, 1.8, 1.9, 6.0, wait_start=1.5, pin=30, pout=7, cached=20),
]


def test_summary_from_records():
    s = summarize(RECORDS)
    assert s["makespan_s"] == pytest.approx(5.0) and s["duration"] == pytest.approx(5.0)
    assert s["completed"] == 4
    assert s["request_throughput"] == pytest.approx(0.8)
    assert (s["total_input_tokens"], s["total_output_tokens"], s["total_cached_tokens"]) == (70, 22, 35)
    # TTFTs 100, 200, 400, 100 ms; e2e 1000, 1500, 500, 4200 ms.
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_ttft_ms"] == pytest.approx(150.0)
    assert s["p99_ttft_ms"] == pytest.approx(400 - 0.03 * 200)
    assert s["median_e2e_latency_ms"] == pytest.approx(1250.0)
    assert s["p99_e2e_latency_ms"] == pytest.approx(4200 - 0.03 * 2700)
    # Trajectories: a 1.0 -> 4.0 = 3 s, b 1.0 -> 6.0 = 5 s.
    assert s["mean_trajectory_s"] == pytest.approx(4.0)
    assert s["p99_trajectory_s"] == pytest.approx(5 - 0.01 * 2)
    assert s["mean_client_wait_ms"] == pytest.approx(400.0)
    assert s["stalls"] is None and s["mean_decode_wait_ms"] is None  # no server metrics given


def test_a_records_json_carries_its_outputs_digest_not_its_ids():
    a, b = rec("a", 0, 1.0, 1.1, 2.0), rec("a", 0, 1.0, 1.1, 2.0)
    a.output_ids, b.output_ids = [5, 6, 7], [5, 6, 7]
    ja, jb = a.to_json(), b.to_json()
    assert "output_ids" not in ja and len(ja["output_digest"]) == 12 and ja == jb
    b.output_ids = [5, 6, 8]
    assert b.to_json()["output_digest"] != ja["output_digest"]


def test_empty_run_is_an_error():
    with pytest.raises(BenchError, match="no completed requests"):
        summarize([])


METRICS_BEFORE = """\
# TYPE pdrollout:decode_wait_seconds histogram
pdrollout:decode_wait_seconds_bucket{le="0.01"} 1.0
pdrollout:decode_wait_seconds_bucket{le="+Inf"} 2.0
pdrollout:decode_wait_seconds_sum 0.5
pdrollout:decode_wait_seconds_count 2.0
# TYPE pdrollout:stalls_total counter
pdrollout:stalls_total{rank="0"} 1.0
pdrollout:stalls_total{rank="1"} 2.0
# TYPE pdrollout:jit_compiles_total counter
pdrollout:jit_compiles_total 5.0
"""
METRICS_AFTER = """\
# TYPE pdrollout:decode_wait_seconds histogram
pdrollout:decode_wait_seconds_bucket{le="+Inf"} 6.0
pdrollout:decode_wait_seconds_sum 0.9
pdrollout:decode_wait_seconds_count 6.0
# TYPE pdrollout:turnstile_rendezvous_seconds histogram
pdrollout:turnstile_rendezvous_seconds_bucket{le="+Inf"} 40.0
pdrollout:turnstile_rendezvous_seconds_sum 0.08
pdrollout:turnstile_rendezvous_seconds_count 40.0
# TYPE pdrollout:turnstile_rounds_total counter
pdrollout:turnstile_rounds_total 41.0
# TYPE pdrollout:stalls_total counter
pdrollout:stalls_total{rank="0"} 4.0
pdrollout:stalls_total{rank="1"} 2.0
# TYPE pdrollout:jit_compiles_total counter
pdrollout:jit_compiles_total 7.0
# TYPE pdrollout:rollout_makespan_seconds gauge
pdrollout:rollout_makespan_seconds 5.25
# TYPE pdrollout:decode_step_seconds histogram
pdrollout:decode_step_seconds_bucket{le="+Inf"} 200.0
pdrollout:decode_step_seconds_sum 5.5
pdrollout:decode_step_seconds_count 200.0
# TYPE pdrollout:p_epoch_seconds histogram
pdrollout:p_epoch_seconds_sum 2.0
pdrollout:p_epoch_seconds_count 10.0
# TYPE pdrollout:p_epoch_enqueue_seconds histogram
pdrollout:p_epoch_enqueue_seconds_sum 0.5
pdrollout:p_epoch_enqueue_seconds_count 10.0
# TYPE pdrollout:p_epoch_cpu_seconds histogram
pdrollout:p_epoch_cpu_seconds_sum 0.25
pdrollout:p_epoch_cpu_seconds_count 10.0
"""


def test_server_measures_from_scrapes():
    before, after = metric_sums(METRICS_BEFORE), metric_sums(METRICS_AFTER)
    assert before["pdrollout:stalls_total"] == 3.0  # summed over label sets
    m = server_measures(before, after)
    assert m["mean_decode_wait_ms"] == pytest.approx(100.0)  # 0.4 s over 4 waits
    assert m["decode_wait_count"] == 4
    assert m["rendezvous_count"] == 40 and m["mean_rendezvous_ms"] == pytest.approx(2.0)
    assert m["turnstile_rounds"] == 41 and m["stalls"] == 3 and m["jit_compiles"] == 2   # 2 compiled during the run
    assert m["server_rollout_makespan_s"] == 5.25
    assert m["decode_steps"] == 200 and m["mean_decode_step_ms"] == pytest.approx(27.5)   # none before
    assert m["p_epochs"] == 10 and m["mean_p_epoch_ms"] == pytest.approx(200.0)
    assert m["mean_p_epoch_enqueue_ms"] == pytest.approx(50.0) and m["mean_p_epoch_cpu_ms"] == pytest.approx(25.0)
    s = summarize(RECORDS, before, after)
    assert s["stalls"] == 3 and s["rendezvous_count"] == 40


def test_same_work_check_and_table():
    base = summarize(RECORDS)
    faster = dict(base, makespan_s=2.5, request_throughput=1.6)
    check_same_work({"normal": base, "pd": faster})
    table = format_table({"normal": base, "pd": faster})
    line = next(ln for ln in table.splitlines() if ln.startswith("makespan"))
    assert "5.00" in line and "2.50" in line and "x0.500" in line
    other = dict(base, total_output_tokens=base["total_output_tokens"] + 1)
    with pytest.raises(BenchError, match="different work.*pd: .*total_output_tokens=23"):
        check_same_work({"normal": base, "pd": other})


def test_repeat_spread_takes_ratios_between_the_modes_median_servers():
    from pdrollout.engine.workload.measures import format_repeats, repeat_spread
    s = lambda mk, p99: {"makespan_s": mk, "p99_ttft_ms": p99}
    out = repeat_spread({"normal": [s(20.0, 300.0), s(22.0, 280.0)], "mixed": [s(17.0, 330.0), s(18.0, 320.0),
                                                                             s(19.0, 340.0)],
                         "pd": [s(16.0, 310.0), s(17.0, 290.0)]})
    assert out["mixed"]["median_makespan_s"] == 18.0 and out["normal"]["median_makespan_s"] == 21.0
    assert out["pd"]["makespan_vs_normal"] == pytest.approx(16.5 / 21.0)
    assert out["pd"]["makespan_vs_mixed"] == pytest.approx(16.5 / 18.0)
    assert out["mixed"]["spread"] == pytest.approx(19.0 / 17.0)
    assert out["pd"]["p99_ttft_vs_normal"] == pytest.approx(300.0 / 290.0)
    assert "makespan_vs_normal" not in out["normal"] and "makespan_vs_mixed" not in out["mixed"]
    table = format_repeats(out)
    assert "16.00-17.00" in table and "x0.786" in table


def test_fleet_groups_and_continuation_hits():
    """Per engine that answered, and the continuation turns' cache hits (a session's first turn is
    never a continuation, whatever its number)."""
    recs = [rec("a", 0, 1.0, 1.1, 2.0, by="e1"), rec("a", 1, 2.5, 2.7, 4.0, pin=20, cached=16, by="e1"),
            rec("b", 3, 1.0, 1.4, 1.5, by="e2"), rec("b", 4, 1.8, 1.9, 6.0, pin=30, by="e1"),
            rec("b", 5, 6.5, 6.6, 7.0, pin=40, cached=32, by="e2")]
    s = summarize(recs)
    assert s["engines"] == 2 and s["continuation_turns"] == 3
    assert s["continuation_cached_share"] == pytest.approx(2 / 3)
    assert s["continuation_cached_ratio"] == pytest.approx((16 + 32) / (20 + 30 + 40))
    e1, e2 = s["groups"]["e1"], s["groups"]["e2"]
    assert (e1["requests"], e2["requests"]) == (3, 2)
    assert e1["makespan_s"] == pytest.approx(6.0 - 1.0) and e2["makespan_s"] == pytest.approx(7.0 - 1.0)
    assert e2["median_ttft_ms"] == pytest.approx((400 + 100) / 2)
    assert e1["continuation_cached_share"] == pytest.approx(1 / 2) and e2["continuation_cached_share"] == 1.0
    assert "continuations cached" in format_table({"fleet": s})
    # records from an older server (no served_by): one group, so the bench prints no per-engine table
    assert summarize(RECORDS)["engines"] == 1 and list(summarize(RECORDS)["groups"]) == ["unknown"]
