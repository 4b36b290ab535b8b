"""The GPU measurement scripts' CPU dry runs (a tiny shape, Triton's interpreter): a script that
breaks is found here, not in a device call's budget."""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def tool_run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    """`python -m e2e.gpu ARGV` from the repo root, as the GPU machine runs it."""
    return subprocess.run([sys.executable, "-m", "e2e.gpu", *argv], cwd=ROOT, **kw)


@pytest.fixture(autouse=True)
def _tool_importable(monkeypatch):
    """The tool's modules import each other as the package e2e.gpu, found from the repo root."""
    monkeypatch.syspath_prepend(str(ROOT))


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    """`python -m e2e.gpu SUBCOMMAND WHAT ARGS` on the CPU (DEVICE=cpu); it must succeed."""
    r = tool_run(list(args), env={**os.environ, "DEVICE": "cpu"}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def test_tool_names_its_subcommands_and_refuses_an_unknown_target():
    """No arguments lists every subcommand's targets; a wrong subcommand or target is named, rc 2."""
    r = tool_run([], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    for line in ("tests: one-stack,", "bench: seeds, plan,", "kernels: moe, attn,", "profile: decode,", "report: repeats,"):
        assert line in r.stderr, r.stderr
    r = tool_run(["kernels", "moe_kernels"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown kernels target 'moe_kernels'" in r.stderr, r.stderr
    r = tool_run(["sweep", "moe"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown subcommand 'sweep'" in r.stderr, r.stderr


def test_no_script_reaches_into_tests_or_edits_sys_path():
    """e2e/gpu is one tool: its modules import each other as the package and share helpers with the tests
    through e2e/harness, never through tests/ or a sys.path edit."""
    offenders = [f"{p.name}:{i}" for p in sorted((ROOT / "e2e" / "gpu").glob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if "sys.path" in line or re.search(r"^\s*(from|import) (tests|hf_reference|pod_launch)\b", line)]
    assert not offenders, offenders


def test_one_stack_and_multinode_dry_runs(tmp_path):
    """`tests one-stack check`: one rank, ATP2 and ADP2 generate transformers' greedy tokens (CPU: no CUDA
    graphs, so no replays); `tests multinode`: the operator's two-node launch forms one engine equal to
    transformers, and node 1 killed mid-run ends node 0 with exit 4. Both import e2e/harness."""
    _dry_run("tests", "one-stack", str(tmp_path / "os"), "check")
    r = json.loads((tmp_path / "os" / "check.json").read_text())
    assert sorted(r["runs"]) == ["1gpu-pd", "2gpu-adp2-normal", "2gpu-atp2-pd"]
    for name, run in r["runs"].items():
        assert run["tokens"] == r["runs"]["1gpu-pd"]["tokens"] and set(run["vs_transformers"]) == {"equal"}, name
        assert run["decode_only_steps"] > 0 and run["graph_replays"] == 0, name
    _dry_run("tests", "multinode", str(tmp_path / "mn"))
    m = json.loads((tmp_path / "mn" / "multinode2.json").read_text())
    assert m["pass"] is True, m


def test_tests_release_resume_dry_run_gives_memory_back_and_generates_the_same_tokens(tmp_path):
    """`tests release-resume` on the tiny preset: two release/resume cycles, the KV cache and weights
    gone while released and back after, and greedy outputs equal before and after."""
    _dry_run("tests", "release-resume", str(tmp_path), "--tokens", "4")
    r = json.loads((tmp_path / "release_resume.json").read_text())
    assert r["outputs_equal"] is True and r["before"] == r["after"] and all(r["before"])
    stages = {row["stage"]: row for row in r["stages"]}
    for cycle in (1, 2):
        assert stages[f"released (all tags) #{cycle}"]["engine_kv_gib"] == 0
        assert stages[f"released (all tags) #{cycle}"]["engine_weights_gib"] == 0
        assert stages[f"resumed kv_cache + cuda_graph #{cycle}"]["engine_kv_gib"] == stages["loaded"]["engine_kv_gib"] > 0
    assert r["meta"]["command"].startswith("python -m e2e.gpu tests release-resume")


def test_moe_kernels_dry_run_checks_bf16_and_fp8_experts_against_the_reference(tmp_path):
    out = tmp_path / "moe.json"
    _dry_run("kernels", "moe", str(out), "--fp8", "--tokens", "1,8")
    rows = json.loads(out.read_text())["rows"]
    assert [row["tokens"] for row in rows] == [1, 8]
    assert all(row["fused_rel_err"] < 2e-2 and 0 < row["fp8_fused_rel_err"] < 3e-2 for row in rows), rows


def _bench_seeds(out, *extra):
    r = _dry_run("bench", "seeds", str(out), "--seeds", "0", "--preset", "tiny", "--model-preset", "tiny",
                 "--model", str(out) + "-model", "--job-timeout", "120", "--variant", "base:normal,mixed:{}", *extra)
    return r.stdout


def _cached(out, pressure, mode):
    res = json.loads((out / "base" / f"{pressure}-s0" / mode / "results.json").read_text())
    return res["modes"][mode]["total_cached_tokens"], res["modes"][mode]["completed"]


def test_bench_seeds_reuses_one_server_per_mode_and_flushes_its_cache_between_runs(tmp_path):
    """Two pressures of one seed send the same prompts: on a reused server the second run finds no
    prefix of the first (the cache was flushed), so it caches what a fresh server's run does."""
    reused, fresh = tmp_path / "reused", tmp_path / "fresh"
    log = _bench_seeds(reused, "--pressures", "P1,P2", "--reuse-server")
    assert log.count("server up") == 2 and log.count(": rc 0 in") == 4, log
    _bench_seeds(fresh, "--pressures", "P2")
    for mode in ("normal", "mixed"):
        assert _cached(reused, "P2", mode) == _cached(fresh, "P2", mode)
    summary = json.loads((reused / "summary.json").read_text())
    assert summary["meta"]["servers"].startswith("one per (variant, mode)")
    assert set(summary["table"]) == {"P1", "P2"}
    rows = summary["table"]["P1"]   # the decode-only steps' mean, and per step against normal's
    assert rows["base/normal"]["decode_step_vs_normal"]["median"] == 1.0
    assert rows["base/mixed"]["mean_decode_step_ms"]["median"] > 0 and rows["base/mixed"]["decode_step_vs_normal"]


def test_bench_seeds_runs_each_engine_on_its_topology(tmp_path):
    """--topology 2/2/2: every server is one engine of two ranks (EP2/ADP2), reused across both
    modes' runs, and the table's meta says so; a topology that does not parse, or GPUs that do not
    cut into engines, are refused before anything runs."""
    out = tmp_path / "x2"
    log = _bench_seeds(out, "--reuse-server", "--step-logs", "--topology", "2/2/2")
    assert log.count("server up") == 2 and log.count(": rc 0 in") == 2, log
    meta = json.loads((out / "summary.json").read_text())["meta"]
    assert meta["nproc"] == 2 and "EP2/ADP2" in meta["topology"]
    for mode in ("normal", "mixed"):   # each rank of the engine wrote its step log
        logs = sorted(p.name for p in (out / "base").glob(f"steps-{mode}-s0/rank*.jsonl"))
        assert logs == ["rank0.jsonl", "rank1.jsonl"], logs
        assert json.loads((out / "base" / "P1-s0" / mode / "results.json").read_text())["modes"][mode]["completed"] > 0
    for bad, says in ((("--topology", "2x2"), "NPROC/ADP/EP"), (("--topology", "2/1/2", "--gpus", "0,1,2"), "engines of 2")):
        r = tool_run(["bench", "seeds", str(tmp_path / "bad"), *bad],
                     capture_output=True, text=True, env={**os.environ, "DEVICE": "cpu"}, timeout=60)
        assert r.returncode == 2 and says in r.stderr, r.stderr
        assert not (tmp_path / "bad" / "meta.json").exists()


def test_bench_seeds_runs_an_fp8_variant_on_block_fp8_weights(tmp_path):
    """"weights": "fp8" is the model's, not an engine field: the variant's server loads a config
    with quantization_config, and its results say so beside the baseline's."""
    out = tmp_path / "fp8"
    _bench_seeds(out, "--pressures", "P2", "--layers", "1")
    (out / "base" / "P2-s0" / "normal" / "results.json").unlink()
    log = _bench_seeds(out, "--pressures", "P2", "--layers", "1", "--skip-existing",
                       "--variant", 'fp8:mixed:{"weights": "fp8"}')
    # resumed: only the jobs without results ran
    assert "1 jobs have results" in log and log.count(": rc 0 in") == 2 and "base P2 seed 0 normal" in log, log
    base = json.loads((out / "base" / "P2-s0" / "mixed" / "results.json").read_text())["modes"]["mixed"]
    fp8 = json.loads((out / "fp8" / "P2-s0" / "mixed" / "results.json").read_text())["modes"]["mixed"]
    assert base["weights"] == "float32" and fp8["weights"] == "fp8-e4m3-128x128"
    assert fp8["completed"] == base["completed"] > 0
    assert "quantization_config" in json.loads((tmp_path / "fp8-model-fp8" / "config.json").read_text())
    table = json.loads((out / "summary.json").read_text())["table"]["P2"]
    assert table["fp8/mixed"]["makespan_vs_mixed"]["n"] == 1
    meta = json.loads((out / "meta.json").read_text())   # the resume's command beside the first one's
    assert [v["name"] for v in meta["variants"]] == ["base"] and len(meta["invocations"]) == 1
    assert [v["name"] for v in meta["invocations"][0]["variants"]] == ["base", "fp8"]
    assert "--skip-existing" in meta["invocations"][0]["command"]


def test_bench_seeds_gives_an_mtp_variant_a_model_with_its_head(tmp_path):
    """`"speculative": "mtp"` needs the checkpoint's head: the variant's model declares one (random
    weights build it), the baseline's does not, and the results say mtp drafted and was verified."""
    out = tmp_path / "mtp"
    _bench_seeds(out, "--pressures", "P2", "--layers", "1",
                 "--variant", 'mtp:pd:{"speculative": "mtp", "speculative_k": 2, "priority": "critical-path"}')
    assert "num_nextn_predict_layers" not in json.loads((tmp_path / "mtp-model" / "config.json").read_text())
    assert json.loads((tmp_path / "mtp-model-mtp1" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    pd = json.loads((out / "mtp" / "P2-s0" / "pd" / "results.json").read_text())["modes"]["pd"]
    assert (pd["speculative"], pd["speculative_k"]) == ("mtp", 2) and pd["completed"] > 0
    assert pd["spec_proposed_drafts"] > 0 and pd["spec_accept_length"] >= 1, pd
    # "priority" is the client's, not an engine field: the variant's bench sent the hint
    meta = lambda v, m: json.loads((out / v / "P2-s0" / m / "results.json").read_text())["meta"]
    assert meta("mtp", "pd")["priority"] == "critical-path" and meta("base", "mixed")["priority"] == "none"


def test_ttft_epochs_groups_first_tokens_that_land_together(tmp_path):
    """Requests whose first tokens land within the window are one batch (one P epoch's end); the
    t=0 burst is left out; new tokens are the prompt less its cached part."""
    from e2e.gpu.ttft_epochs import summary
    rec = lambda rel, first, prompt, cached: {"release_s": rel, "first_token_s": first, "prompt_tokens": prompt,
                                              "cached_tokens": cached}
    records = [rec(0.0, 0.4, 500, 0),                                          # the burst: left out
               rec(1.0, 1.30, 120, 100), rec(1.1, 1.301, 50, 0), rec(1.2, 1.302, 30, 10),   # one epoch
               rec(1.4, 1.50, 80, 0)]                                          # the next
    s = summary(records, window_s=0.003, skip_s=1.0)
    assert s["requests"] == 4 and s["batches"] == 2
    assert s["median_new_tokens_per_batch"] == (90 + 80) / 2
    assert abs(s["median_gap_ms"] - 200.0) < 1e-6
    assert abs(s["median_ttft_ms"] - 151.5) < 1e-6   # of 300, 201, 102, 100 ms
    log = tmp_path / "pd"
    log.mkdir()
    (log / "records-pd.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    r = tool_run(["report", "ttft", str(tmp_path)],
                 capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    name, reqs, p50, batches = r.stdout.splitlines()[1].split()[:4]
    assert (name, reqs, batches) == ("pd/pd", "4", "2") and abs(float(p50) - 151.5) <= 0.5


def test_spy_summary_splits_one_threads_samples_by_our_frames_and_its_leaves(tmp_path):
    """py-spy's folded stacks of a server: only the stacks through the P epoch count, each of our
    frames once per stack (inclusive), leaves and their libraries by self time."""
    epoch = "thread (0x1);_bootstrap (threading.py:1);_epoch (/r/engine/runtime/solo_p.py:30);" \
            "forward (/r/engine/runtime/worker.py:200);"
    folded = tmp_path / "pyspy.txt"
    folded.write_text("\n".join([
        epoch + "attend (/r/engine/model/backends.py:74);cuLaunchKernel (libcuda.so.1) 6",
        epoch + "take_gil (libpython3.12.so.1.0) 3",
        epoch + "experts (/r/engine/model/backends.py:87);cuLaunchKernel (libcuda.so.1) 1",
        "thread (0x2);main (cli.py:1);step (/r/engine/runtime/engine.py:135);cudaStreamSynchronize (libcudart.so.13) 50",
    ]) + "\n")
    r = tool_run(["profile", "spy", str(folded), "--json", str(tmp_path / "s.json")],
                 capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["samples"] == 10
    ours = {row["frame"].split(" ")[0]: row["share"] for row in s["ours_inclusive"]}
    assert ours == {"_epoch": 1.0, "forward": 1.0, "attend": 0.6, "experts": 0.1}
    assert [(row["frame"].split(" ")[0], row["share"]) for row in s["leaf_self"]] == \
        [("cuLaunchKernel", 0.7), ("take_gil", 0.3)]
    assert {row["frame"]: row["share"] for row in s["library_self"]} == {"libcuda.so.1": 0.7, "libpython3.12.so.1.0": 0.3}
    r = tool_run(["profile", "spy", str(folded), "--match", "no_such_frame"],
                 capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no sampled stack passes through a frame matching 'no_such_frame' (60 samples" in r.stderr
    folded.write_text("not folded\n")
    r = tool_run(["profile", "spy", str(folded)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "line 1: not 'frame;frame;... COUNT'" in r.stderr


def test_bench_seeds_py_spy_needs_a_server_of_its_own(tmp_path):
    r = tool_run(["bench", "seeds", str(tmp_path), "--py-spy", "5",
                  "--variant", "spy:pd:{}"], env={**os.environ, "DEVICE": "cpu"},
                 capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--py-spy needs --reuse-server" in r.stderr
    r = tool_run(["bench", "seeds", str(tmp_path), "--py-spy", "15.0",
                  "--reuse-server"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid int value: '15.0'" in r.stderr


def test_py_spy_is_given_whole_seconds():
    """py-spy panicked on `-d 15.0` (its duration is an integer) and the H200 run sampled nothing."""
    from e2e.gpu.bench_seeds import spy_command
    cmd = spy_command(123, Path("/tmp/x.txt"), 15)
    assert cmd[cmd.index("-d") + 1] == "15" and cmd[cmd.index("-p") + 1] == "123"
    for bad in (15.0, 0, "15"):
        try:
            spy_command(123, Path("/tmp/x.txt"), bad)
        except ValueError as e:
            assert "whole seconds" in str(e)
        else:
            raise AssertionError(f"{bad!r} accepted")


def test_decode_ab_alternates_the_activation_on_one_pd_server(tmp_path):
    """Every run is served by one pd server whose live control was switched before it: the pairs
    alternate which activation goes first, every run completes all its rows, and the table's ratios
    come from the pairs."""
    out = tmp_path / "ab"
    r = _dry_run("bench", "decode-ab", str(out), "--model", str(tmp_path / "m"), "--model-preset", "tiny",
                 "--rows", "3", "--output", "6", "--pairs", "2")
    assert r.stdout.count("server up") == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["order"] == [[0, "off"], [0, "auto"], [1, "auto"], [1, "off"]]
    for pair in summary["runs"].values():
        for activation, res in pair.items():
            assert res["mode"] == activation and res["completed"] == 3 and res["total_output_tokens"] == 18
    assert summary["table"]["makespan_s"]["auto_vs_off"]["n"] == 2
    log = (out / "server.log").read_text()
    assert log.count("control set to") == 4 and "'activation': 'off'" in log and "'activation': 'auto'" in log


def test_attn_kernels_dry_run_checks_every_swept_tile_shape(tmp_path):
    out = tmp_path / "attn.json"
    _dry_run("kernels", "attn", str(out), "--sweep")
    row = json.loads(out.read_text())["rows"][0]
    assert row["default_rel_err"] < 2e-2 and len(row["sweep"]) == 2
    assert {e["config"]["block_m"] for e in row["sweep"]} == {16, 32} and all(e["rel_err"] < 2e-2 for e in row["sweep"])
    r = tool_run(["kernels", "attn", str(out), "--shapes", "16k"],
                 env={**os.environ, "DEVICE": "cpu"}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "unknown shapes ['16k']" in r.stderr


def test_decode_attn_dry_run_checks_every_swept_launch_against_the_reference(tmp_path):
    """Tiles, splits (with their merge) and the default launch against fp64 attention, on shuffled blocks."""
    out = tmp_path / "decode.json"
    _dry_run("kernels", "decode-attn", str(out), "--sweep")
    row = json.loads(out.read_text())["rows"][0]
    assert (row["batch"], row["ctx"]) == (3, 40) and row["default_rel_err"] < 2e-2
    assert {(e["config"]["tile"], e["config"]["kv_splits"]) for e in row["sweep"]} == {(16, 1), (16, 2), (32, 1), (32, 2)}
    assert all(e["rel_err"] < 2e-2 for e in row["sweep"]), row["sweep"]
    r = tool_run(["kernels", "decode-attn", str(out), "--shapes", "64"],
                 env={**os.environ, "DEVICE": "cpu"}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "BATCHxCONTEXT" in r.stderr


def test_critical_path_splits_the_last_sessions_time():
    """The last session to end is the critical one: its start, first-token waits, decode time and
    tool gaps add up to its end; its decode ms per token is set beside the other sessions'; the
    run's floor is the latest start plus tool gaps of any session."""
    from e2e.gpu.critical_path import summary
    rec = lambda sid, turn, rel, first, done, toks: {"session_id": sid, "turn": turn, "release_s": rel,
                                                     "first_token_s": first, "done_s": done, "completion_tokens": toks}
    records = [rec("a", 1, 2.5, 2.6, 4.6, 100), rec("a", 0, 0.5, 0.7, 2.0, 50),     # turns out of order
               rec("b", 0, 0.0, 0.1, 3.1, 100)]
    s = summary(records)
    assert s["session"] == "a" and s["turns"] == 2 and s["tokens"] == 150
    assert abs(s["ttft_s"] - 0.3) < 1e-9 and abs(s["decode_s"] - 3.3) < 1e-9 and abs(s["gaps_s"] - 0.5) < 1e-9
    assert abs(s["start_s"] + s["ttft_s"] + s["decode_s"] + s["gaps_s"] - s["end_s"]) < 1e-9
    assert abs(s["ms_per_token"] - 22.0) < 1e-9 and abs(s["others_ms_per_token"] - 30.0) < 1e-9
    # no engine time: a starts at 0.5 and waits its 0.5-s gap; b starts at 0 with none
    assert abs(s["floor_s"] - 1.0) < 1e-9 and abs(s["floor_share"] - 1.0 / 4.6) < 1e-9
    records.append(rec("c", 0, 3.0, 3.1, 3.2, 1))   # a late arrival bounds the run alone
    assert abs(summary(records)["floor_s"] - 3.0) < 1e-9


def _result(root, variant, seed, mode, makespan, **extra):
    d = root / variant / f"P1-s{seed}" / mode
    d.mkdir(parents=True, exist_ok=True)
    r = {"makespan_s": makespan, "p99_ttft_ms": 100.0 * makespan, "mean_decode_step_ms": 10.0, **extra}
    (d / "results.json").write_text(json.dumps({"meta": {}, "modes": {mode: r}}))


def test_spec_matrix_takes_pd_ratios_within_a_variant_and_a_later_call_replaces_a_run(tmp_path):
    """pd's ratios are against the same variant's normal/mixed of the same seed (the paper's
    P/D-vs-Normal under each precision and MTP setting); a variant's cells against the baseline
    variant in the same mode; a run found again in a later call replaces the earlier one; a cell
    no call ran is "–", and a ratio needs both of its runs."""
    c1, c2 = tmp_path / "call1", tmp_path / "call2"
    for s, k in ((0, 1.0), (1, 2.0), (2, 3.0)):
        for mode, m in (("normal", 10.0), ("mixed", 8.0), ("pd", 9.0)):
            _result(c1, "base", s, mode, m * k)
        _result(c1, "mtp2", s, "normal", 20.0 * k, spec_accept_length=1.5)
        _result(c1, "mtp2", s, "pd", 999.0)                            # replaced by call 2's
        _result(c2, "mtp2", s, "pd", 18.0 * k, spec_accept_length=1.5, speculative="mtp", speculative_k=2)
    out = tmp_path / "m.json"
    r = tool_run(["report", "spec-matrix", str(out), str(c1), str(c2)],
                 capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    t = json.loads(out.read_text())["table"]["P1"]
    assert t["base"]["pd_vs_normal"]["median"] == 0.9 and t["base"]["pd_vs_mixed"]["median"] == 9 / 8
    assert t["mtp2"]["pd_vs_normal"] == {"median": 0.9, "min": 0.9, "max": 0.9, "n": 3}
    assert t["mtp2"]["pd"]["vs_base"]["median"] == 2.0 and t["mtp2"]["normal"]["vs_base"]["median"] == 2.0
    assert t["mtp2"]["pd"]["makespan_s"]["median"] == 36.0 and t["mtp2"]["speculative_k"] == 2
    assert t["mtp2"]["pd_vs_mixed"] is None and t["mtp2"]["mixed"]["makespan_s"] is None
    assert "| mtp2 | 40.00 (20.00–60.00) | – | 36.00 (18.00–54.00) | 0.900" in r.stdout
    bad = tool_run(["report", "spec-matrix", str(out), str(tmp_path / "nope")],
                   capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "not a directory" in bad.stderr


def test_gil_handoff_times_each_switch_interval(tmp_path):
    out = tmp_path / "gil.json"
    r = subprocess.run([sys.executable, str(ROOT / "e2e/gil_handoff.py"), "--rounds", "5", "--block-ms", "1",
                        "--intervals", "1,0.2", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert [row["interval_ms"] for row in d["rows"]] == [1.0, 0.2]
    # a blocked loop never resumes early, and the busy thread ran beside it
    assert all(row["late_median_ms"] > -0.05 and row["busy_spins_per_s"] > 0 for row in d["rows"]), d


def test_d_beside_p_dry_run_times_steps_alone_and_beside_each_kind_of_p_thread(tmp_path):
    out = tmp_path / "dbp.json"
    _dry_run("bench", "d-beside-p", str(out), "--intervals", "5,0.2")
    d = json.loads(out.read_text())
    assert [row["interval_ms"] for row in d["rows"]] == [5.0, 0.2] and d["meta"]["p_tokens"] == 16
    for row in d["rows"]:   # every kind ran beside the steps, and each step took time
        assert row["alone_step_ms"] > 0 and row["spin_repeats"] > 0 and row["eager_repeats"] > 0, row
        assert row["eager_step_ms"] > 0 and row["spin_over_alone"] > 0, row


def test_fused_step_dry_run_times_d_steps_fused_steps_and_p_alone(tmp_path):
    """Each fused step carried exactly its continuation's new tokens (the prompt a prefix-cache hit)."""
    out = tmp_path / "fs.json"
    _dry_run("bench", "fused-step", str(out), "--new", "8,16")
    d = json.loads(out.read_text())
    assert d["d_step_ms"] > 0 and [row["new"] for row in d["rows"]] == [8, 16]
    assert all(row["fused_ms"] > 0 and row["p_alone_ms"] > 0 for row in d["rows"]), d["rows"]


def test_routing_check_dry_run_counts_experts_and_compares_greedy_tokens(tmp_path):
    """Routing reported for the decode steps and the random prompt tokens, counted per layer; on the
    CPU (fp32, no graphs) the three runs of the same prompts generate the same tokens."""
    out = tmp_path / "rc.json"
    _dry_run("bench", "routing", str(out))
    d = json.loads(out.read_text())
    routing = d["routing"]
    experts, top_k = 8, 2    # the tiny preset
    for name, rows in (("all", 6), ("subset", 3)):
        r = routing[name]
        assert r["rows"] == rows and r["uniform"] == pytest.approx(experts * (1 - (1 - top_k / experts) ** rows))
        for key in ("decode_distinct", "random_prompt_distinct"):
            assert top_k <= r[key]["min"] <= r[key]["max"] <= min(experts, rows * top_k), (name, key, r[key])
    assert 1 <= routing["tokens"]["distinct_across_rows_per_step"]["max"] <= 6
    assert d["batch"]["graphed_vs_routed"] == {"rows": 6, "equal": 6, "first_difference": {"median": 8, "min": 8, "max": 8}}
    assert d["batch"]["subset_alone_vs_graphed"]["equal"] == 3 and d["replay"] is None


def _records(path, digests: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"session_id": s, "turn": t, "output_digest": h}) + "\n"
                            for (s, t), h in digests.items()))


def test_same_tokens_finds_each_sessions_first_differing_turn(tmp_path):
    a = {("s0", 0): "x", ("s0", 1): "y", ("s0", 2): "z", ("s1", 0): "p", ("s1", 1): "q"}
    b = {**a, ("s0", 1): "Y", ("s0", 2): "Z"}         # s0 differs from its second turn on
    _records(tmp_path / "a" / "records-mixed.jsonl", a)
    _records(tmp_path / "b" / "records-mixed.jsonl", b)
    r = tool_run(["report", "same-tokens", str(tmp_path / "a"), str(tmp_path / "b"),
                  "--json", str(tmp_path / "same.json")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    (c,) = json.loads((tmp_path / "same.json").read_text())
    assert (c["equal"], c["requests"], c["first_turns_equal"], c["sessions_all_equal"]) == (3, 5, 2, 1)
    assert c["median_first_differing_turn"] == 1.5     # s0 at turn 1, s1 never (its 2 turns)
    _records(tmp_path / "c" / "records-pd.jsonl", {k: None for k in a})
    r = tool_run(["report", "same-tokens", str(tmp_path / "a"), str(tmp_path / "c")],
                 capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "output_digest" in r.stderr


def test_drift_dry_run_times_both_stretches(tmp_path):
    out = tmp_path / "drift.json"
    _dry_run("bench", "drift", str(out))
    d = json.loads(out.read_text())
    assert set(d["stretch_median_ms"]) == {"hot", "again"} and d["replay_ms"]["median"] > 0
    assert d["seconds"] and all(r["ms"] is None or r["ms"] > 0 for r in d["seconds"])


def test_drift_reads_nvidia_smis_rows_and_leaves_unreported_fields_empty(tmp_path):
    from e2e.gpu import drift
    f = tmp_path / "smi.csv"
    f.write_text("2026/12/04 11:50:01.250, 45, 61, 512.30, 1980, 3201, 0x0000000000000000\n"
                 "2026/12/04 11:50:01.350, 46, [N/A], 530.00, 1965, 3201, 0x0000000000000004\n"
                 "garbage line\n")
    t0 = time.mktime(time.strptime("2026/12/04 11:50:01", "%Y/%m/%d %H:%M:%S"))
    rows = drift.read_samples(f, t0)
    assert len(rows) == 2 and rows[0]["t"] == pytest.approx(0.25) and rows[1]["t"] == pytest.approx(0.35)
    assert rows[0]["temperature.memory"] == 61 and rows[1]["temperature.memory"] is None
    assert rows[1]["clocks_throttle_reasons.active"] == 4 and rows[1]["power.draw"] == 530.0


def test_kv_scatter_dry_run_builds_consecutive_and_scattered_tables(tmp_path):
    out = tmp_path / "kv.json"
    _dry_run("kernels", "kv-scatter", str(out))
    d = json.loads(out.read_text())
    blocks = -(-d["meta"]["ctx"] // d["meta"]["block_size"])
    assert [r["rows"] for r in d["rows"]] == [1, 2]
    for r in d["rows"]:   # every row's blocks distinct, in both placements
        assert r["distinct_blocks"] == {"consecutive": r["rows"] * blocks, "random": r["rows"] * blocks}, r
    from e2e.gpu import kv_scatter
    g = __import__("torch").Generator().manual_seed(1)
    a, b = (kv_scatter.tables(3, 4, 30, p, g) for p in ("consecutive", "random"))
    assert a.flatten().tolist() == list(range(12)) and set(b.flatten().tolist()) <= set(range(12, 30))
    assert len(set(b.flatten().tolist())) == 12


def test_step_pairs_lines_two_runs_up_and_splits_d_time_by_matching_rows(tmp_path):
    def step(i, rows, p, gpu, rset="s", ctx=100, wall=0.01):
        return {"step": i, "decode_rows": rows, "prefill_tokens": p, "p_flight": None, "wall_s": wall,
                "d_gpu_s": gpu if rows and not p else None, "decode_set": rset, "decode_ctx_tokens": ctx}
    burst = [step(1, 0, 9000, None)]   # a run opens with its burst of first turns
    a = burst + [step(2, 4, 0, 0.010), step(3, 4, 0, 0.010), step(4, 2, 0, 0.005)]
    # step 3 attends other keys; step 4 other request ids (another run's naming) over the same keys
    b = burst + [step(2, 4, 0, 0.011), step(3, 4, 0, 0.012, rset="t", ctx=150),
                 step(4, 2, 0, 0.005, rset="u", wall=0.02)]
    for name, steps in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "rank0.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    r = tool_run(["report", "step-pairs", str(tmp_path / "a"), str(tmp_path / "b"),
                  "--json", str(tmp_path / "pairs.json")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    (c,) = json.loads((tmp_path / "pairs.json").read_text())
    assert (c["steps_a"], c["same_shape"], c["same_rows"], c["same_ctx"], c["d_timed"], c["d_same"]) == (4, 4, 1, 2, 3, 2)
    assert c["d_gpu_b_over_a_same"] == pytest.approx(0.016 / 0.015)
    assert c["d_gpu_b_over_a_other"] == pytest.approx(1.2) and c["d_ctx_b_over_a_other"] == pytest.approx(1.5)
    assert c["d_wall_b_over_a"] == pytest.approx(0.04 / 0.03) and c["p_wall_b_over_a"] == pytest.approx(1.0)


def test_padding_routes_dry_run(tmp_path):
    """The CPU has no decode graphs, but runs P's pieces eagerly through their buffers and padding:
    the P forwards' records (masked and not, repeats, against the eager forward) are all made."""
    out = tmp_path / "pr.json"
    _dry_run("bench", "padding-routes", str(out), "--rows", "1,3", "--reps", "5", "--p-shapes", "1x5x16,2x7x20")
    d = json.loads(out.read_text())
    assert [r["rows"] for r in d["rows"]] == [1, 3] and d["meta"]["batch"] == 32
    assert [(p["shape"], p["tokens"], p["bucket"]) for p in d["p_forwards"]] == [("1x5x16", 5, 16), ("2x7x20", 14, 16)]
    for p in d["p_forwards"]:
        # every shape on its own slots: no forward reads another's K/V as context, so a recapture
        # and the other shapes' forwards between two rounds leave the logits as they were
        assert p["repeats_equal"] == p["rounds_equal"] == {"skip": True, "route": True}
        assert len(p["each_ms"]["skip"]) == len(p["each_ms"]["route"]) == 2
        # the real rows' logits within fp32 rounding of each other and of the eager forward's
        assert all(v["max"] < 1e-4 and v["of"] == p["tokens"] // int(p["shape"].split("x")[1])
                   for v in p["differ"].values())


def test_step_costs_bins_steps_by_kind_and_p_tokens(tmp_path):
    """A step log's steps by kind (D, P+D fused, the step starting an epoch, D beside it) and P size."""
    import gzip
    from e2e.gpu.step_costs import compiled, costs, read
    step = lambda i, d, p, wall, **kw: {"step": i, "decode_rows": d, "prefill_tokens": p, "wall_s": wall,
                                         "p_flight": None, "p_pending": False, **kw}
    log = [step(0, 1, 1, 9.0), step(1, 8, 0, 0.010), step(2, 8, 0, 0.012), step(3, 8, 100, 0.020),
           step(4, 8, 900, 0.030, p_pending=True), step(5, 8, 0, 0.018, p_flight=4), step(6, 0, 5000, 0.1)]
    path = tmp_path / "rank0.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(s) for s in log))
    rows = {(r["kind"], r["p_tokens"]): r for r in costs(read(tmp_path))}
    assert set(rows) == {("D", "-"), ("P+D", "<=128"), ("P+D (epoch)", "<=1024"), ("D beside P", "-"), ("P", ">4096")}
    assert rows[("D", "-")]["steps"] == 2 and rows[("D", "-")]["wall_ms"] == pytest.approx(11.0)
    assert rows[("P+D", "<=128")]["total_s"] == pytest.approx(0.020)
    assert compiled(log) is None   # a log from before the engine counted compiles
    log[3]["jit_compiles"], log[6]["jit_compiles"] = ["gate_up", "down"], []
    assert compiled(log) == [{"step": 3, "wall_ms": pytest.approx(20.0), "prefill_tokens": 100, "decode_rows": 8,
                              "kernels": ["gate_up", "down"]}]


def test_step_costs_bound_prices_d_rows_and_charges_p_the_rest(tmp_path):
    """--bound: runs split at each burst, D rows priced by the D-only line, every other step's excess
    charged to P, and the makespan P could give back at the bulk rate or for free."""
    from e2e.gpu.step_costs import bounds, runs
    step = lambda d, p, wall, **kw: {"step": 1, "decode_rows": d, "prefill_tokens": p, "wall_s": wall,
                                     "p_flight": None, **kw}
    d = lambda rows: step(rows, 0, 0.005 + 0.001 * rows)      # D-only: 5 ms + 1 ms a row, exactly
    warm = [dict(step(0, 32768, 0.4), step=0)]                  # the warm-up: never a run
    run = [step(0, 600, 0.03), step(0, 9000, 0.09), d(8), d(4), step(4, 100, 0.013), d(2),
           step(2, 0, 0.010, p_flight=3)]
    log = warm + run + run
    assert [len(r) for r in runs(log)] == [len(run), len(run)]
    b = bounds(log)
    assert len(b) == 2 and b[0]["d_ms"] == pytest.approx((5.0, 1.0))
    assert b[0]["bulk_us_per_token"] == pytest.approx(10.0)     # 9,000 tokens in 90 ms, the only bulk step
    # P's cost: the two P-only steps whole, the fused step's 4 ms over 9 ms, the epoch's 3 ms over 7 ms
    assert b[0]["p_cost_s"] == pytest.approx(0.03 + 0.09 + 0.004 + 0.003)
    total = sum(s["wall_s"] for s in run)
    assert b[0]["total_s"] == pytest.approx(total) and b[0]["p_tokens"] == 9700
    assert b[0]["bound_free"] == pytest.approx((total - 0.127) / total)
    assert b[0]["bound_floor"] == pytest.approx((total - 0.127 + 9700 * 10e-6) / total)


def test_step_costs_bound_json_names_each_runs_seed_from_the_logs_name(tmp_path):
    """--bound --json: a run's seed comes from its log's name (steps-<mode>-s3-4); an old-named log
    takes its block's seeds from the bench's meta.json, and none where the counts disagree."""
    step = lambda d, p, wall: {"step": 1, "decode_rows": d, "prefill_tokens": p, "wall_s": wall, "p_flight": None}
    run = [step(0, 9000, 0.09), step(4, 0, 0.009), step(2, 0, 0.007), step(2, 50, 0.012)]
    (tmp_path / "meta.json").write_text(json.dumps({"commit": "abc", "machine": "m", "nproc": 1, "topology": "t",
                                                    "blocks": [{"seeds": [0, 1, 2]}, {"seeds": [5]}]}))
    for name, n in (("steps-pd-s3-4", 2), ("steps-pd-b1", 1), ("steps-pd", 2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "rank0.jsonl").write_text("\n".join(json.dumps(s) for s in run * n))
    out = tmp_path / "b.json"
    r = tool_run(["report", "step-costs", "--bound", "--json", str(out),
                  *(str(tmp_path / n) for n in ("steps-pd-s3-4", "steps-pd-b1", "steps-pd"))],
                 capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    b = json.loads(out.read_text())
    seeds = {Path(k).name: [row.get("seed") for row in v] for k, v in b["logs"].items()}
    assert seeds == {"steps-pd-s3-4": [3, 4], "steps-pd-b1": [5], "steps-pd": [None, None]}
    src = b["meta"]["sources"][str(tmp_path / "steps-pd-s3-4")]
    assert (src["commit"], src["nproc"], src["topology"], src["seeds"]) == ("abc", 1, "t", [3, 4])


def test_step_costs_d_speed_compares_the_same_rows_run_by_run(tmp_path):
    """--d-speed A B: per run, the median over row counts of A's D-only graph step over B's at the
    same count; steps with P, beside an epoch, eager, or at counts either side ran too rarely are out."""
    from e2e.gpu.step_costs import d_speed
    step = lambda d, p, wall, graph=True, **kw: {"step": 1, "decode_rows": d, "prefill_tokens": p, "wall_s": wall,
                                                 "p_flight": None, "graph": graph, **kw}
    def log(scale: list[float]) -> list[dict]:
        out = []
        for k in scale:   # one run per factor: a burst, then D-only steps at 2 and 4 rows (and noise)
            out += [step(0, 9000, 0.09)]
            out += [step(2, 0, 0.010 * k)] * 5 + [step(4, 0, 0.020 * k)] * 5 + [step(8, 0, 0.5)] * 4
            out += [step(2, 50, 0.5), step(2, 0, 0.5, graph=False), step(2, 0, 0.5, p_flight=3)]
        return out
    rows = d_speed(log([1.05, 1.0]), log([1.0, 1.0]))
    assert [r["row_counts"] for r in rows] == [2, 2]   # 8 rows: 4 steps a side, too few
    assert rows[0]["ratio"] == pytest.approx(1.05) and rows[1]["ratio"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="2 and 1 runs"):
        d_speed(log([1.0, 1.0]), log([1.0]))
    a, b = tmp_path / "a", tmp_path / "b"
    for d, scale in ((a, [1.05, 1.0]), (b, [1.0, 1.0])):
        d.mkdir()
        (d / "rank0.jsonl").write_text("\n".join(json.dumps(s) for s in log(scale)))
    r = tool_run(["report", "step-costs", "--d-speed", str(a), str(b)],
                 capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert [line.split() for line in r.stdout.splitlines()[1:]] == [["0", "2", "1.050"], ["1", "2", "1.000"]]
    assert rows[0]["gpu_ratio"] is None and rows[0]["host_ms_a"] is None   # untimed logs


def test_step_costs_d_speed_places_a_difference_on_the_gpu_or_the_host(tmp_path):
    """Logs with the replay's GPU time (d_gpu_s): A's steps are 1 ms slower on the host at equal
    GPU time in run 0, and 10 % slower on the GPU in run 1."""
    from e2e.gpu.step_costs import d_speed
    step = lambda d, gpu, host: {"step": 1, "decode_rows": d, "prefill_tokens": 0, "p_flight": None, "graph": True,
                                 "wall_s": gpu + host, "d_gpu_s": gpu}
    def log(runs):
        out = []
        for gpu_k, host in runs:
            out += [{"step": 1, "decode_rows": 0, "prefill_tokens": 9000, "wall_s": 0.09, "p_flight": None, "graph": False}]
            out += [step(2, 0.010 * gpu_k, host)] * 5 + [step(4, 0.020 * gpu_k, host)] * 5
        return out
    rows = d_speed(log([(1.0, 0.002), (1.1, 0.001)]), log([(1.0, 0.001), (1.0, 0.001)]))
    assert rows[0]["gpu_ratio"] == pytest.approx(1.0) and rows[1]["gpu_ratio"] == pytest.approx(1.1)
    assert rows[0]["host_ms_a"] == pytest.approx(2.0) and rows[0]["host_ms_b"] == pytest.approx(1.0)
    assert rows[1]["host_ms_a"] == pytest.approx(1.0)
    assert rows[0]["ratio"] == pytest.approx(statistics.median([0.012 / 0.011, 0.022 / 0.021]))
    a, b = tmp_path / "a", tmp_path / "b"
    for d, runs in ((a, [(1.0, 0.002), (1.1, 0.001)]), (b, [(1.0, 0.001), (1.0, 0.001)])):
        d.mkdir()
        (d / "rank0.jsonl").write_text("\n".join(json.dumps(s) for s in log(runs)))
    r = tool_run(["report", "step-costs", "--d-speed", str(a), str(b)],
                 capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "GPU A / B" in r.stdout.splitlines()[0]
    assert [line.split()[3:] for line in r.stdout.splitlines()[1:]] == [["1.000", "2.00", "1.00"], ["1.100", "1.00", "1.00"]]


def test_bench_seeds_blocks_reverse_the_server_order_in_every_other_block():
    """--blocks 2: seeds 0-2 on servers normal, mixed, pd; seeds 3-4 on new servers pd, mixed, normal
    (a drift over the call no longer falls on the last mode only)."""
    from e2e.gpu.bench_seeds import parse_variant, seed_blocks, server_groups
    assert seed_blocks([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert seed_blocks([0, 1, 2], 1) == [[0, 1, 2]] and seed_blocks([0, 1], 5) == [[0], [1]]
    base = parse_variant("base:normal,mixed,pd:{}")
    jobs = [{"variant": base, "pressure": "P1", "seed": s, "mode": m} for s in range(5) for m in ("normal", "mixed", "pd")]
    groups = server_groups(jobs, [0, 1, 2, 3, 4], 2)
    assert [(g[0]["mode"], [j["seed"] for j in g], g[0]["block"]) for g in groups] == [
        ("normal", [0, 1, 2], 0), ("mixed", [0, 1, 2], 0), ("pd", [0, 1, 2], 0),
        ("pd", [3, 4], 1), ("mixed", [3, 4], 1), ("normal", [3, 4], 1)]
    assert [g[0]["mode"] for g in server_groups(jobs, [0, 1, 2, 3, 4], 1)] == ["normal", "mixed", "pd"]


def _plan(tmp_path, part: str, seeds: str) -> tuple[Path, list[list[str]]]:
    """`bench plan` PART SEEDS on the CPU (tiny shape): its OUT, and each server's (variant, mode)
    in the order they came up."""
    out = tmp_path / "out"
    r = tool_run(["bench", "plan", str(out), part, seeds, "--", "--preset", "tiny",
                  "--model-preset", "tiny", "--model", str(tmp_path / "model"), "--job-timeout", "300"],
                 env={**os.environ, "DEVICE": "cpu", "COMMIT": "dry-run", "PART_BUDGET_S": "400"},
                 capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # "gpu None VARIANT MODE: server up in N s"
    return out, [[line.split()[2], line.split()[3].rstrip(":")] for line in r.stdout.splitlines() if "server up" in line]


def test_bench_plan_runs_a_part_in_blocks_and_packs_it(tmp_path):
    """`bench plan` p1 on two seeds: the second seed's servers run in reverse order, and the
    part comes back packed (what a device call returns) with its table and step logs."""
    import tarfile
    out, servers = _plan(tmp_path, "p1", "0,1")
    ups = [mode for _, mode in servers]
    assert ups == ["normal", "mixed", "pd", "pd", "mixed", "normal"], servers
    with tarfile.open(out / "p1.tgz") as t:
        members = t.getmembers()
    names = {m.name for m in members}
    assert {"p1/summary.json", "p1/meta.json", "p1/bounds.txt"} <= names, sorted(names)
    assert names & {"p1/base/steps-pd-s1/rank0.jsonl", "p1/base/steps-pd-s1/rank0.jsonl.gz"}, sorted(names)
    # packed as committed: no plain log over 100 KB
    assert all(m.size <= 100 * 1024 for m in members if m.name.endswith(".jsonl")), \
        [(m.name, m.size) for m in members if m.name.endswith(".jsonl")]
    meta = json.loads((out / "p1" / "meta.json").read_text())
    assert meta["commit"] == "dry-run" and [b["order"] for b in meta["blocks"]] == ["forward", "reversed"]


def _summary(name, variants, per_mode):
    """A bench_seeds summary: `per_mode` {variant/mode: {seed: (makespan s, p99 TTFT ms)}}."""
    table = {"P1": {vm: {"per_seed": {str(s): {"makespan_s": m, "p99_ttft_ms": p} for s, (m, p) in seeds.items()}}
                    for vm, seeds in per_mode.items()}}
    return {"meta": {"commit": name, "machine": "m", "nproc": 1, "topology": "t", "variants": variants}, "table": table}


def test_repeats_takes_each_modes_median_server_and_leaves_other_configurations_out(tmp_path):
    """Three identical `mixed` servers and two `pd` ones on one seed: the ratios are taken between the
    modes' median servers, the spread is max / min per mode, the pairs' range covers every pd × mixed
    pair, and a variant with extra settings is not pooled."""
    from e2e.gpu import repeats
    plain = lambda n, modes: {"name": n, "modes": modes, "extra": {}, "weights": "bf16", "mtp_layers": 0,
                              "priority": "none"}
    a = _summary("c1", [plain("base", "normal,mixed,pd"), plain("m2", "mixed"),
                        {**plain("f", "pd"), "extra": {"solo_fuse_tokens": 128}}],
                 {"base/normal": {0: (20.0, 300.0)}, "base/mixed": {0: (17.0, 330.0)}, "base/pd": {0: (16.0, 310.0)},
                  "m2/mixed": {0: (18.0, 320.0)}, "f/pd": {0: (1.0, 1.0)}})
    b = _summary("c2", [plain("base", "normal,mixed"), plain("q2", "pd")],
                 {"base/normal": {0: (22.0, 280.0)}, "base/mixed": {0: (19.0, 340.0)}, "q2/pd": {0: (17.0, 290.0)}})
    by_mode, left = repeats.servers([("a", a), ("b", b)], "P1")
    assert left == ["a:f/pd"]
    assert [len(by_mode[m]) for m in repeats.MODES] == [2, 3, 2]
    t = repeats.table(by_mode)
    r = t["per_seed"][0]
    assert r["makespan_s"] == {"normal": 21.0, "mixed": 18.0, "pd": 16.5}
    assert r["pd_vs_mixed"] == pytest.approx(16.5 / 18.0) and r["pd_vs_normal"] == pytest.approx(16.5 / 21.0)
    assert r["server_spread"]["mixed"] == pytest.approx(19.0 / 17.0)
    assert r["pd_vs_mixed_pairs"] == pytest.approx({"min": 16.0 / 19.0, "max": 17.0 / 17.0})
    assert r["p99_ttft_pd_vs_normal"] == pytest.approx(300.0 / 290.0)
    out = tmp_path / "r.json"
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    (tmp_path / "a" / "summary.json").write_text(json.dumps(a))
    (tmp_path / "b" / "summary.json").write_text(json.dumps(b))
    assert repeats.main(["--json", str(out), str(tmp_path / "a" / "summary.json"), str(tmp_path / "b" / "summary.json")]) == 0
    meta = json.loads(out.read_text())["meta"]
    assert meta["commits"] == ["c1", "c2"] and meta["seeds"] == [0] and meta["left_out"] == ["a:f/pd"]
    with pytest.raises(ValueError, match="no server of pd"):
        repeats.table({"normal": by_mode["normal"], "mixed": by_mode["mixed"], "pd": []})


def test_plan_spread_part_runs_identical_servers_and_compares_them(tmp_path):
    """`bench plan` spread on one seed: two normal, three mixed and two pd servers, then the
    repeated-servers table over them (packed with the part)."""
    import tarfile
    out, servers = _plan(tmp_path, "spread", "0")
    assert servers == [["base", "normal"], ["base", "mixed"], ["base", "pd"], ["m2", "mixed"], ["m3", "mixed"],
                       ["q2", "pd"], ["n2", "normal"]], servers
    rep = json.loads((out / "spread" / "repeats.json").read_text())
    assert rep["per_seed"][0]["servers"] == {"normal": 2, "mixed": 3, "pd": 2}
    with tarfile.open(out / "spread.tgz") as t:
        names = set(t.getnames())
    assert {"spread/repeats.md", "spread/d_speed.txt", "spread/summary.json"} <= names, sorted(names)


def test_bench_seeds_pins_a_variants_server_to_its_cpus(tmp_path):
    """"cpus" pins the server's process tree: the affinity read back from the running server is the
    one asked for, a variant without it runs anywhere, and a CPU list that is malformed or names CPUs
    this machine lacks is refused before anything runs."""
    allowed = sorted(os.sched_getaffinity(0))
    out = tmp_path / "pin"
    log = _bench_seeds(out, "--pressures", "P2", "--layers", "1", "--reuse-server",
                       "--variant", f'pin:mixed:{{"cpus": "{allowed[0]}"}}')
    assert "base normal: server up in" in log and log.count("on cpus any") == 2, log
    assert "pin mixed: server up" in log and f"on cpus {allowed[0]}\n" in log, log
    pin = json.loads((out / "pin" / "P2-s0" / "mixed" / "results.json").read_text())["modes"]["mixed"]
    assert pin["completed"] > 0
    assert [v.get("cpus") for v in json.loads((out / "meta.json").read_text())["variants"]] == [None, str(allowed[0])]
    for cpus, says in (("0-x", "not a CPU list"), ("3-1", "empty or negative"),
                       (f"{allowed[-1] + 1}", "not among this process's CPUs")):
        r = tool_run(["bench", "seeds", str(tmp_path / "bad"), "--reuse-server",
                      "--variant", f'bad:normal,mixed:{{"cpus": "{cpus}"}}'],
                     capture_output=True, text=True, env={**os.environ, "DEVICE": "cpu"}, timeout=60)
        assert r.returncode == 2 and "variant bad: cpus" in r.stderr and says in r.stderr, r.stderr
    r = tool_run(["bench", "seeds", str(tmp_path / "bad"),
                  "--variant", 'bad:normal,mixed:{"cpus": "0"}'],
                 capture_output=True, text=True, env={**os.environ, "DEVICE": "cpu"}, timeout=60)
    assert r.returncode == 2 and "needs --reuse-server" in r.stderr, r.stderr
    assert not (tmp_path / "bad" / "meta.json").exists()


def test_bench_seeds_passes_no_kv_size_unless_asked(tmp_path):
    """The P1 bench leaves one GPU's engine to size its own cache (kv_sizing.py); --kv-cache-bytes
    still sets it, and its servers run with it (their start's log line says the bytes)."""
    from e2e.gpu.bench_seeds import MULTI_RANK_KV_BYTES, engine_config, parse_variant
    base = parse_variant("base:pd:{}")
    assert "kv_cache_bytes" not in engine_config(base)
    assert engine_config(base, nproc=2)["kv_cache_bytes"] == MULTI_RANK_KV_BYTES   # several ranks measure nothing
    assert engine_config(base, 1 << 30)["kv_cache_bytes"] == 1 << 30
    assert engine_config(parse_variant('v:pd:{"kv_cache_bytes": 5}'), 1 << 30)["kv_cache_bytes"] == 5   # the variant's wins
    out = tmp_path / "kv"
    _bench_seeds(out, "--pressures", "P2", "--reuse-server", "--kv-cache-bytes", str(8 << 20))
    assert json.loads((out / "meta.json").read_text())["engine_config"]["kv_cache_bytes"] == 8 << 20
    logs = list((out / "base").glob("server-*.log"))
    assert logs
    for log in logs:
        m = re.search(r"KV cache: (\d+) blocks .*\[kv_cache_bytes=(\d+)\]", log.read_text())
        assert m, log.read_text()[-2000:]
        blocks, kv_bytes = int(m[1]), int(m[2])
        assert blocks == (8 << 20) // (kv_bytes // (blocks + 1))   # the cache holds one null block beyond


def test_ep2_rank_dry_run_runs_the_shard_and_the_whole_model_through_the_d_path(tmp_path):
    """`bench ep2-rank`: EP rank 0 of 2 (half the experts) and the whole model, each through the multi-rank
    D path over a one-rank group; the other half's pairs go to no peer, so the shard issues the same two
    collectives a layer and its floor counts half the expert bytes."""
    out = tmp_path / "ep2.json"
    _dry_run("bench", "ep2-rank", str(out), "--rows", "8", "--ctx", "40", "--one-rows", "4", "--one-ctx", "40")
    r = json.loads(out.read_text())
    shard, whole = r["ep2_rank"], r["one_gpu"]
    assert shard["local_experts"] * 2 == whole["local_experts"] and shard["finite"] and whole["finite"]
    assert shard["d_collectives"] == whole["d_collectives"] == 2 * r["meta"]["layers"]
    assert shard["kv_bytes"] == 2 * whole["kv_bytes"]   # twice the rows at the same context
    assert whole["max_abs_diff_vs_one_rank"] <= 1e-5 * whole["ref_scale"]   # the D path is one rank's forward
