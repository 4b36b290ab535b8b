"""The tiny bench end to end: real `pdrollout serve` per mode on 127.0.0.1, on CPU."""
import json
import subprocess
import sys

import pytest

from pdrollout.engine.workload.trace import generate, stats

MODES = ("normal", "mixed", "pd")


def _pdrollout(*args, timeout):
    cmd = [sys.executable, "-c", "import sys; from pdrollout.engine.cli import main; sys.exit(main())",
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-model")
    r = _pdrollout("checkpoint", "--config", "tiny", "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stderr
    return out


def test_tiny_bench_all_modes_same_work(tiny_model, tmp_path):
    out = tmp_path / "bench"
    r = _pdrollout("bench", "--modes", ",".join(MODES), "--model", str(tiny_model),
                   "--preset", "tiny", "--pressure", "P2", "--device", "cpu", "--no-progress",
                   "--out", str(out), timeout=900)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in out.glob("server-*.log"))
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\n{logs}"
    data = json.loads((out / "results.json").read_text())
    assert list(data["modes"]) == list(MODES)
    want = stats(generate("tiny", 0))
    for mode in MODES:
        m = data["modes"][mode]
        assert m["completed"] == want["requests"], mode
        assert (m["total_input_tokens"], m["total_output_tokens"]) == \
            (want["input_tokens"], want["output_tokens"]), mode
        assert m["makespan_s"] > 0 and m["p99_ttft_ms"] >= m["median_ttft_ms"] > 0
        assert m["total_cached_tokens"] > 0, f"{mode}: no prefix reuse across turns"
    # The table printed ratios to normal for the other modes.
    assert "pd/normal" in r.stdout and "mixed/normal" in r.stdout
    for name in ("makespan.png", "ttft_cdf.png", "timeline.png"):
        assert (out / name).stat().st_size > 1000
