"""The GPU measurement scripts' CPU dry runs (a tiny shape, Triton's interpreter): a script that
breaks is found here, not in a device call's budget."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_moe_kernels_dry_run_checks_bf16_and_fp8_experts_against_the_reference(tmp_path):
    out = tmp_path / "moe.json"
    r = subprocess.run([sys.executable, str(ROOT / "e2e/gpu/moe_kernels.py"), str(out), "--fp8", "--tokens", "1,8"],
                       env={**os.environ, "DEVICE": "cpu"}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["tokens"] for row in rows] == [1, 8]
    assert all(row["fused_rel_err"] < 2e-2 and 0 < row["fp8_fused_rel_err"] < 3e-2 for row in rows), rows
