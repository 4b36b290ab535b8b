"""The GPU timeline's arithmetic (issue 8): interval overlap and the per-rank summary. The timelines
themselves come from CUDA events (`python -m e2e.gpu tests stall`, e2e/gpu/stall.py); here synthetic ones with known answers."""
from __future__ import annotations

import pytest

from pdrollout.engine.runtime.gpu_timeline import is_registered, overlap_ms, summarize


@pytest.mark.parametrize("a,b,want", [
    ([(0, 10)], [(10, 20)], 0.0),                      # touching, not overlapping
    ([(0, 10)], [(5, 20)], 5.0),
    ([(0, 10), (20, 30)], [(5, 25)], 10.0),            # one interval across two
    ([(0, 10), (2, 8)], [(0, 10)], 10.0),              # a set's own overlaps count once
    ([(0, 4), (3, 6)], [(1, 2), (5, 9)], 2.0),
    ([], [(0, 1)], 0.0),
])
def test_overlap_ms(a, b, want):
    assert overlap_ms(a, b) == pytest.approx(want)
    assert overlap_ms(b, a) == pytest.approx(want)


def _span(name, phase, t0, t1, registered=False):
    return {"name": name, "phase": phase, "t0_ms": t0, "t1_ms": t1, "registered": registered, "stream": 1}


def _enq(key, t, registered=True):
    return {"key": key, "t_ns": t, "registered": registered}


def test_registered_names():
    assert is_registered("P", "attn-allreduce") and is_registered("P", "moe-allreduce")
    assert is_registered("D", "dp-allgather") and is_registered("D", "dp-reducescatter")
    assert not is_registered("P", "dispatch") and not is_registered("D", "atp-allreduce")


def test_summary_measures_the_pair_and_p_compute_against_d():
    rank0 = {"spans": [_span("forward", "D", 0, 10), _span("dp-allgather", "D", 2, 4, True),
                       _span("attn-allreduce", "P", 3, 6, True),          # 1 ms on the pair
                       _span("atp-allreduce", "D", 5, 7),                  # + 1 ms on any D collective
                       _span("compute", "P", 8, 14), _span("dispatch", "P", 20, 21)],
             "enqueues": [_enq("D:1:0:dp-allgather", 1), _enq("P:1:0:attn-allreduce", 2)],
             "rendezvous_s": [0.001, 0.003]}
    rank1 = {"spans": [_span("forward", "D", 0, 10)],
             "enqueues": [_enq("D:1:0:dp-allgather", 5), _enq("P:1:0:attn-allreduce", 9)], "rendezvous_s": []}
    s = summarize({0: rank0, 1: rank1})
    r = s["ranks"][0]
    assert r["registered_pair_overlap_ms"] == pytest.approx(1.0)
    assert r["registered_p_overlapping_d_collectives_ms"] == pytest.approx(2.0)
    assert r["p_compute_overlapping_d_forward_ms"] == pytest.approx(2.0)
    assert r["p_collectives_overlapping_d_forward_ms"] == 0.0 and r["p_compute_ms"] == pytest.approx(6.0)
    assert r["rendezvous"] == 2 and r["rendezvous_mean_ms"] == pytest.approx(2.0)
    assert s["ranks"][1]["rendezvous_mean_ms"] is None
    assert s["order_violations"] == []


def test_summary_reports_a_crossed_order():
    a = {"spans": [], "enqueues": [_enq("D:1:0:dp-allgather", 1), _enq("P:1:0:attn-allreduce", 2)]}
    b = {"spans": [], "enqueues": [_enq("P:1:0:attn-allreduce", 1), _enq("D:1:0:dp-allgather", 2)]}
    v = summarize({0: a, 2: b})["order_violations"]
    assert len(v) == 1 and "ranks 0 and 2 disagree" in v[0]
