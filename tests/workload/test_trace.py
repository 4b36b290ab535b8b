"""Synthetic trace: paper statistics, determinism, preset shape, pressure points, file round trip."""
import json

import pytest

from pdrollout.engine.workload import trace
from pdrollout.engine.workload.cli import add_trace_parser

# docs/WORKLOAD.md, typed in here on purpose (not read from the module under test).
PAPER = {
    "new_prompt": (292, 2008, 3062),
    "output": (88, 391, 1057),
    "retained_context": (4716, 8828, 12507),
    "wait_s": (3.1, 3.9, 15.0),
}


def _within(got, want, tol):
    return abs(got - want) <= tol * want


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_paper_preset_matches_design_within_10pct(seed):
    st = trace.stats(trace.generate("paper", seed))
    assert (st["conversations"], st["requests"], st["continuations"]) == (128, 1265, 1137)
    assert st["max_turns"] == 10
    for name, (p50, p90, p99) in PAPER.items():
        g50, g90, g99 = st["percentiles"][name]
        assert _within(g50, p50, 0.10), (name, "p50", g50, p50)
        assert _within(g90, p90, 0.10), (name, "p90", g90, p90)
        assert _within(g99, p99, 0.30), (name, "p99", g99, p99)  # p99 rests on ~13 requests
    assert _within(st["input_tokens"], 6_574_104, 0.10)
    assert _within(st["output_tokens"], 220_862, 0.10)


def test_same_seed_same_trace_other_seed_differs():
    a, b, c = trace.generate("paper", 3), trace.generate("paper", 3), trace.generate("paper", 4)
    assert a == b
    assert a != c


def test_rows_are_well_formed_sessions():
    rows = trace.generate("small", 0)
    for turns in trace.sessions(rows).values():
        assert [r["turn"] for r in turns] == list(range(len(turns)))
        assert turns[0]["delay_ms"] == 0 and turns[0]["timestamp"] == 0
        assert all("timestamp" not in r and r["delay_ms"] > 0 for r in turns[1:])
        assert all(r["input_length"] >= 1 and r["output_length"] >= 1 for r in turns)


@pytest.mark.parametrize("preset", ["small", "tiny"])
def test_presets_keep_the_shape(preset):
    p = trace.PRESETS[preset]
    st = trace.stats(trace.generate(preset, 0))
    assert st["conversations"] == p.conversations and st["requests"] == p.requests
    assert st["max_turns"] <= p.max_turns
    if preset == "tiny":
        assert p.conversations <= 8 and p.max_turns <= 4
    # Scaled lengths: the median lands on paper x scale; the spread (p90/p50) stays the paper's.
    for name in ("new_prompt", "output"):
        g50, g90, _ = st["percentiles"][name]
        want50, want90, _ = PAPER[name]
        assert abs(g50 - want50 * p.length_scale) <= max(1.5, 0.15 * want50 * p.length_scale)
        assert _within(g90 / g50, want90 / want50, 0.30), (name, g90 / g50)
    assert _within(st["percentiles"]["wait_s"][0], 3.1, 0.10)  # waits are time: not scaled


@pytest.mark.parametrize("point,factor", [("P1", 0.0), ("P2", 0.01), ("P3", 0.03), ("P4", 0.10)])
def test_pressure_scales_only_the_waits(point, factor):
    base = trace.generate("small", 5)
    scaled = trace.generate("small", 5, pressure=point)
    assert len(base) == len(scaled)
    for b, s in zip(base, scaled):
        assert {k: v for k, v in b.items() if k != "delay_ms"} == \
            {k: v for k, v in s.items() if k != "delay_ms"}
        assert abs(s["delay_ms"] - b["delay_ms"] * factor) <= 0.5 + 0.5 * factor  # two roundings
    with pytest.raises(ValueError, match="unknown pressure"):
        trace.generate("small", 5, pressure="P9")


def test_jsonl_round_trip_and_cli(tmp_path, capsys):
    import argparse
    path = tmp_path / "t.jsonl"
    parser = argparse.ArgumentParser()
    add_trace_parser(parser.add_subparsers())
    a = parser.parse_args(["trace", "--preset", "small", "--seed", "2", "--out", str(path)])
    assert a.func(a) == 0
    assert trace.read_jsonl(str(path)) == trace.generate("small", 2)
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) >= {"session_id", "turn", "input_length", "output_length", "delay_ms"}
    a = parser.parse_args(["trace", "--stats", str(path), "--preset", "small"])
    assert a.func(a) == 0
    out = capsys.readouterr().out
    assert "retained_context" in out and "36.5/251/382.75" in out


def test_read_jsonl_reports_missing_fields(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"session_id": "a", "input_length": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: missing field\(s\) \['output_length'\]"):
        trace.read_jsonl(str(p))
