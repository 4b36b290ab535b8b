"""The soak (e2e/soak.py) in CI: 1,000 turnstile rounds (the 10,000-round run is in docs/perf/soak) on the real 4-rank engine (CPU, gloo,
one device slot per rank, random rank skew up to 50 ms): 0 stalls, 0 violations."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "e2e" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(900)
def test_soak_1000_rounds(tiny_model, tmp_path, capsys):
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(ROOT / "e2e" / "soak.py"), "--rounds", "1000", "--model", str(tiny_model),
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=840)
    with capsys.disabled():
        print("\n" + run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    res = json.loads(out.read_text())
    r = res["results"]
    assert r["rounds"] >= 1000 and r["rounds_metrics"] == r["rounds"]
    assert r["stalls"] == 0 and r["exit_code"] == 0 and res["violations_total"] == 0
    # the skew really was injected on every rank, up to the bound
    assert r["skew_injected_ms"]["count"] >= 4 * 100 and 0 < r["skew_injected_ms"]["max"] <= 50
    assert r["rendezvous_ms"]["count"] == 2 * 4 * r["rounds"]
    assert res["meta"]["commit"] and res["meta"]["machine"]["cores"]


def test_soak_analysis_reports_disagreement():
    """The checks that count violations do fire: a missing step, disagreeing rounds, a rank
    with the wrong number of rendezvous."""
    soak = _soak_module()
    rec = lambda rank, step, rounds, rdv: {"step": step, "rank": rank, "rounds": rounds, "control": {"span": 1},
                                            "rendezvous_s": [0.001] * rdv, "skew_ms": [1.0]}
    per_rank = {0: {1: rec(0, 1, 2, 4), 2: rec(0, 2, 1, 2), 3: rec(0, 3, 1, 2), 4: rec(0, 4, 1, 2)},
                1: {1: rec(1, 1, 2, 4), 2: rec(1, 2, 2, 4), 3: rec(1, 3, 1, 1), 4: rec(1, 4, 1, 2)},
                2: {1: rec(2, 1, 2, 4), 3: rec(2, 3, 1, 2), 4: rec(2, 4, 1, 2)}}
    violations: list[str] = []
    stats = soak.analyse(per_rank, 3, violations)
    assert any("step 2: missing on ranks [2]" in v for v in violations), violations
    assert any("step 3 rank 1: 1 rendezvous for 1 rounds" in v for v in violations), violations
    per_rank[2][2] = rec(2, 2, 1, 2)
    violations = []
    soak.analyse(per_rank, 3, violations)
    assert any("step 2: ranks disagree on rounds [1, 2, 1]" in v for v in violations), violations
    assert stats["rounds"] == 2 + 1 + 1
