"""The tiny bench end to end: real `pdrollout serve` per mode on 127.0.0.1, on CPU."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pdrollout.engine.workload.trace import generate, stats

MODES = ("normal", "mixed", "pd")


def _pdrollout(*args, timeout):
    cmd = [sys.executable, "-c", "import sys; from pdrollout.engine.cli import main; sys.exit(main())",
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")   # per worker: each test a unit of its own (tests/lanes.py)
def tiny_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-model")
    r = _pdrollout("checkpoint", "--config", "tiny", "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stderr
    return out


def test_tiny_bench_all_modes_same_work(tiny_model, tmp_path):
    out = tmp_path / "bench"
    r = _pdrollout("bench", "--modes", ",".join(MODES), "--model", str(tiny_model),
                   "--preset", "tiny", "--pressure", "P2", "--device", "cpu", "--no-progress",
                   "--priority", "critical-path", "--out", str(out), timeout=900)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in out.glob("server-*.log"))
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\n{logs}"
    data = json.loads((out / "results.json").read_text())
    assert list(data["modes"]) == list(MODES) and data["meta"]["priority"] == "critical-path"
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


def _children(pid: int) -> list[int]:
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return kids


def test_bench_fails_fast_with_the_log_when_its_server_dies(tiny_model, tmp_path):
    """The server a bench started dies mid-replay (SIGKILL of its whole tree): the bench exits 1 within
    seconds, saying so with the server's log tail, instead of waiting on requests that cannot end."""
    out = tmp_path / "bench"
    cmd = [sys.executable, "-c", "import sys; from pdrollout.engine.cli import main; sys.exit(main())", "bench",
           "--modes", "pd", "--model", str(tiny_model), "--preset", "tiny", "--pressure", "trace",  # 14 s of waits
           "--device", "cpu", "--no-progress", "--out", str(out)]
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        log, deadline = out / "server-pd.log", time.monotonic() + 300
        while not (log.exists() and "ready on http://" in log.read_text()):
            assert bench.poll() is None and time.monotonic() < deadline, bench.communicate()
            time.sleep(0.2)
        time.sleep(1.0)                                      # requests in flight
        server = [k for k in _children(bench.pid) if b"serve" in open(f"/proc/{k}/cmdline", "rb").read()]
        assert len(server) == 1, server
        os.killpg(server[0], signal.SIGKILL)                 # the server leads its own process group
        t_kill = time.monotonic()
        stdout, stderr = bench.communicate(timeout=60)
        took = time.monotonic() - t_kill
    finally:
        if bench.poll() is None:
            bench.kill()
    assert bench.returncode == 1, (stdout, stderr)
    assert took < 15, f"the bench took {took:.1f}s to notice"
    assert "bench failed: the server exited with -9 during the replay" in stderr, stderr
    assert "ready on http://" in stderr, "the server's log tail is missing"


def test_bench_results_carry_the_servers_speculation_and_its_acceptance(tiny_model, tmp_path):
    """A server with n-gram speculation: the results name it and sum the requests' meta_info
    acceptance (drafts proposed and accepted, output tokens per D iteration); the work is the same.
    --no-plots: results and records, no PNG."""
    out = tmp_path / "bench"
    r = _pdrollout("bench", "--modes", "pd", "--model", str(tiny_model), "--preset", "tiny", "--pressure", "P2",
                   "--device", "cpu", "--no-progress", "--no-plots", "--out", str(out), "--serve-arg=--speculative",
                   "--serve-arg=ngram", "--serve-arg=--speculative-k", "--serve-arg=3", timeout=600)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert not list(out.glob("*.png")) and (out / "records-pd.jsonl").exists()
    m = json.loads((out / "results.json").read_text())["modes"]["pd"]
    want = stats(generate("tiny", 0))
    assert (m["speculative"], m["speculative_k"], m["weights"]) == ("ngram", 3, "float32")
    assert m["total_output_tokens"] == want["output_tokens"]
    assert 0 <= m["spec_accepted_drafts"] <= m["spec_proposed_drafts"]
    assert m["spec_accept_rate"] == m["spec_accepted_drafts"] / m["spec_proposed_drafts"]
    # each D iteration emits its target token plus the accepted drafts
    assert 1.0 <= m["spec_accept_length"] <= 4.0


def test_a_bench_server_ends_when_the_bench_is_killed(tiny_model, tmp_path):
    """SIGKILL of a process inside `servers.serve` (no `finally` runs, as under `timeout -s KILL` or
    an OOM kill): its server gets SIGTERM from the kernel (parent-death signal) and exits, instead of
    living on with the GPU."""
    script = ("import sys, time\n"
              "from pdrollout.engine.workload.servers import serve\n"
              f"with serve({str(tiny_model)!r}, 'pd', {str(tmp_path / 'server.log')!r}, device='cpu') as live:\n"
              "    print(live.proc.pid, flush=True)\n"
              "    time.sleep(600)\n")
    bench = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        server = int(bench.stdout.readline())
        assert os.path.exists(f"/proc/{server}")
        bench.kill()
        bench.wait()
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{server}") and time.monotonic() < deadline:
            with open(f"/proc/{server}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":   # exited, waiting for a reaper
                    break
            time.sleep(0.2)
        gone = not os.path.exists(f"/proc/{server}") or open(f"/proc/{server}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    finally:
        if bench.poll() is None:
            bench.kill()
    if not gone:
        os.killpg(server, signal.SIGKILL)
    assert gone, f"the server outlived its bench by 30 s; log:\n{(tmp_path / 'server.log').read_text()[-2000:]}"


def test_bench_repeats_each_mode_on_fresh_servers_and_takes_the_median_server(tiny_model, tmp_path):
    """--repeats 2 on two modes: four servers, the second round in reverse order, each server's step
    log by its run name ({run}); results.json keeps every server's makespan and the ratio between the
    modes' medians, and the records of every server."""
    out = tmp_path / "bench"
    r = _pdrollout("bench", "--modes", "normal,pd", "--model", str(tiny_model), "--preset", "tiny", "--pressure",
                   "P1", "--device", "cpu", "--no-progress", "--no-plots", "--repeats", "2", "--out", str(out),
                   "--serve-arg=--step-log", f"--serve-arg={tmp_path}/steps/{{run}}", timeout=900)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    order = [line.split(":")[0].removeprefix("[bench] ") for line in r.stdout.splitlines() if "server " in line
             and " of 2:" in line]
    assert order == ["mode normal, server 1 of 2", "mode pd, server 1 of 2", "mode pd, server 2 of 2",
                     "mode normal, server 2 of 2"], r.stdout
    data = json.loads((out / "results.json").read_text())
    rep = data["meta"]["repeats"]["by_mode"]
    assert [rep[m]["servers"] for m in ("normal", "pd")] == [2, 2]
    for m in ("normal", "pd"):
        mk = rep[m]["makespan_s"]
        assert rep[m]["median_makespan_s"] == pytest.approx(sum(mk) / 2)
        assert rep[m]["spread"] == pytest.approx(max(mk) / min(mk))
        assert data["modes"][m]["makespan_s"] == min(mk)   # the lower median server stands for the mode
    assert rep["pd"]["makespan_vs_normal"] == pytest.approx(rep["pd"]["median_makespan_s"] / rep["normal"]["median_makespan_s"])
    assert {p.name for p in out.glob("records-*.jsonl")} == {f"records-{m}-r{i}.jsonl" for m in ("normal", "pd")
                                                              for i in (0, 1)}
    assert sorted(p.name for p in (tmp_path / "steps").iterdir()) == ["normal-r0", "normal-r1", "pd-r0", "pd-r1"]
    assert "repeated servers" in r.stdout
    bad = _pdrollout("bench", "--url", "http://127.0.0.1:9", "--repeats", "2", "--out", str(tmp_path / "x"), timeout=60)
    assert bad.returncode == 2 and "--repeats starts fresh servers" in bad.stderr
