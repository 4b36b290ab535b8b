"""The operator's reading of the engine's /metrics, checked against the engine's own exposition."""
import pytest

from pdrollout.engine.protocol.metrics import TTFT_WINDOW
from pdrollout.engine.server.metrics import ServerMetrics
from pdrollout.operator import engine_client as ec


def test_recent_ttft_p99_is_a_real_request_not_a_bucket_interpolation():
    """The issue's case: TTFTs around 11 s in buckets (10, 20]: interpolating the histogram says ~19.9 s,
    the engine's own records say what the slowest 1 % really saw."""
    sm = ServerMetrics()
    for ttft in [0.5] * 90 + [11.1] * 10:
        sm.first_token(ttft)
    m = ec.parse_metrics(sm.exposition().decode())
    assert m.recent_ttft_p99_s == 11.1


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
    assert m.recent_ttft_p99_s == 0.5
    sm.rollout_makespan.set(12.5)
    sm.rollouts_finished.inc()
    assert ec.parse_metrics(sm.exposition().decode()).makespan_s == 12.5
    # The window keeps the last TTFT_WINDOW only: an old slow request ages out.
    for _ in range(TTFT_WINDOW):
        sm.first_token(0.04)
    assert ec.parse_metrics(sm.exposition().decode()).recent_ttft_p99_s == 0.04


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
