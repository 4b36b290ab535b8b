"""The operator's reading of the engine's /metrics, checked against the engine's own exposition."""
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdrollout.engine.server.metrics import ServerMetrics
from pdrollout.operator import engine_client as ec


def test_histogram_quantile_interpolates_like_prometheus():
    # 100 observations: 50 in (0,1], 40 in (1,2], 10 in (2,4]
    buckets = [(1.0, 50), (2.0, 90), (4.0, 100), (float("inf"), 100)]
    assert ec.histogram_quantile(0.5, buckets) == pytest.approx(1.0)
    assert ec.histogram_quantile(0.7, buckets) == pytest.approx(1.5)
    assert ec.histogram_quantile(0.99, buckets) == pytest.approx(2.0 + 2.0 * 9 / 10)
    assert ec.histogram_quantile(0.99, [(1.0, 0), (float("inf"), 0)]) is None
    assert ec.histogram_quantile(0.99, [(1.0, 0), (float("inf"), 5)]) == 1.0  # all beyond the last bound


def test_quantile_matches_a_real_histogram():
    reg = CollectorRegistry()
    h = Histogram("pdrollout:time_to_first_token_seconds", "t", buckets=(0.1, 0.2, 0.4, 0.8), registry=reg)
    for v in [0.05] * 90 + [0.3] * 9 + [0.7]:
        h.observe(v)
    m = ec.parse_metrics(generate_latest(reg).decode())
    # rank 99 of 100 lies at the top of the (0.2, 0.4] bucket
    assert m.ttft_p99_s == pytest.approx(0.4)


def test_parse_the_engines_own_metrics():
    sm = ServerMetrics()
    for ttft in (0.02, 0.03, 0.5):
        sm.first_token(ttft)
    for w in (0.001, 0.003):
        sm.decode_wait.observe(w)
    text = sm.exposition().decode()
    m = ec.parse_metrics(text)
    assert m.makespan_s is None, "no rollout finished yet: no makespan"
    assert m.mean_decode_wait_s == pytest.approx(0.002)
    assert 0.4 < m.ttft_p99_s <= 0.6
    sm.rollout_makespan.set(12.5)
    sm.rollouts_finished.inc()
    assert ec.parse_metrics(sm.exposition().decode()).makespan_s == 12.5


def test_empty_metrics_give_no_figures():
    m = ec.parse_metrics("")
    assert m == ec.EngineMetrics()


def test_unreachable_engine_is_a_health_result_not_an_exception():
    # Port 9 (discard) on loopback: nothing listens, the connection is refused at once.
    h = ec.health("http://127.0.0.1:9")
    assert not h.ok and not h.reachable and "127.0.0.1:9" in h.detail
    with pytest.raises(ec.EngineError):
        ec.get_control("http://127.0.0.1:9")


def test_weight_version_from_a_real_engine(tiny_model):
    """GET /get_weight_version of a real `pdrollout serve`, before and after a version change."""
    from serverproc import ServerProcess
    s = ServerProcess(tiny_model)
    try:
        assert ec.weight_version(s.url) == "default"
        r = s.http.post("/update_weight_version", json={"new_version": "step-7"})
        assert r.status_code == 200 and r.json()["new_version"] == "step-7", r.text
        assert ec.weight_version(s.url) == "step-7"
        with pytest.raises(ec.EngineError, match="HTTP 404"):
            ec.weight_version(s.url + "/nothing-here")
    finally:
        assert s.stop() == 0
    with pytest.raises(ec.EngineError):
        ec.weight_version("http://127.0.0.1:9")
