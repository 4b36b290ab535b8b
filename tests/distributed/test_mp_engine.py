"""The multi-rank engine through the real CLI: rank processes over gloo, the tiny model.

Greedy outputs on several topologies equal one rank's; a /control change lands at the same step
on every rank; a bad topology fails before any process starts; the crossed isolation-only order
stalls on the real model and the watchdog reports every rank's frontier. Every run has a hard
timeout that kills its whole process group."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from pdrollout.engine.model.checkpoint import write_checkpoint
from pdrollout.engine.protocol.config import load_preset

pytestmark = pytest.mark.timeout(900)
ENGINE = {"block_size": 4, "num_blocks": 256, "mixed_chunk_tokens": 20}
BUDGET = {"prefill_budget_tokens": 24}
PROMPTS = [[(i * 37 + k * 11) % 500 + 2 for k in range(3 + 9 * i)] for i in range(4)]


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`pdrollout ARGS` in its own session; on timeout the whole group dies (no rank survives)."""
    p = subprocess.Popen([sys.executable, "-m", "pdrollout.engine.cli", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"pdrollout {' '.join(args)} ran past {timeout}s\n{err[-3000:]}")
    return subprocess.CompletedProcess(args, p.returncode, out, err)


@pytest.fixture(scope="session")   # per worker: each test a unit of its own (tests/lanes.py)
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("mp")
    model = write_checkpoint(load_preset("tiny"), d / "tiny", seed=0)
    reqs = d / "reqs.jsonl"
    reqs.write_text("".join(json.dumps({"rid": f"r{i}", "input_ids": p, "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}) + "\n" for i, p in enumerate(PROMPTS)))
    return str(model), str(reqs), d


def _generate(setup, mode, control=None, ranks=None, extra=(), timeout=240, engine=None):
    model, reqs, _ = setup
    args = ["generate", "--model", model, "--requests", reqs, "--mode", mode,
            "--engine-config", json.dumps({**ENGINE, **(engine or {})}),
            "--control", json.dumps({**BUDGET, **(control or {})})]
    if ranks:
        n, adp, ep = ranks
        args += ["--nproc", str(n), "--adp", str(adp), "--ep", str(ep), *extra]
    return _run(args, timeout)


def _outputs(res) -> list[list[int]]:
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(line)["output_ids"] for line in res.stdout.splitlines()]


_REF: dict[str, list] = {}


def _reference(setup, mode):
    if mode not in _REF:
        _REF[mode] = _outputs(_generate(setup, mode, timeout=120))
    return _REF[mode]


FINE = {"ordering": "fine-grained", "activation": "on", "span": 1}
CASES = [((4, 2, 4), "pd", FINE, ["--slots", "1"]),          # crossed ATP2/ADP2, one slot
         ((4, 2, 4), "normal", {}, []),
         ((4, 4, 4), "pd", FINE, []),
         ((4, 4, 4), "normal", {}, []),
         ((2, 1, 2), "pd", {"ordering": "fine-grained", "span": "auto"}, []),
         ((4, 2, 4), "pd", FINE, ["--rank-skew-ms", "5"]),                 # random per-rank D delays
         ((4, 2, 4), "mixed", {}, []),
         ((4, 4, 4), "mixed", {}, []),
         ((2, 1, 2), "normal", {}, []),
         ((2, 1, 2), "mixed", {}, []),
         ((2, 2, 2), "pd", FINE, []),                                      # uncrossed: no turnstile
         ((2, 2, 2), "pd", {"ordering": "global-enqueue", "span": 1}, ["--rank-skew-ms", "5"]),
         ((2, 2, 2), "normal", {}, []),
         ((2, 2, 2), "mixed", {}, [])]


@pytest.mark.parametrize("ranks,mode,control,extra", CASES,
                         ids=[f"{'-'.join(map(str, c[0]))}-{c[1]}{'-skew' if '--rank-skew-ms' in c[3] else ''}"
                              for c in CASES])
def test_greedy_equals_one_rank(setup, ranks, mode, control, extra):
    ref = _reference(setup, mode)
    got = _outputs(_generate(setup, mode, control, ranks, extra))
    assert len(ref) == len(PROMPTS) and all(len(r) == 5 for r in ref)
    assert got == ref



def test_dissemination_rendezvous_through_the_cli(setup):
    """--rendezvous reaches every rank: the crossed 4/2/4 pd run with the log transport gives one
    rank's tokens, and every rank's step log names the transport and times each round."""
    _, _, d = setup
    log = d / "steplog-dissemination"
    got = _outputs(_generate(setup, "pd", FINE, (4, 2, 4),
                             ["--slots", "1", "--rendezvous", "dissemination", "--step-log", str(log)]))
    assert got == _reference(setup, "pd")
    for r in range(4):
        steps = [json.loads(x) for x in (log / f"rank{r}.jsonl").read_text().splitlines()]
        assert {e["rendezvous"] for e in steps} == {"dissemination"}
        timed = [t for e in steps for t in e["round_t"]]
        assert len(timed) == sum(e["rounds"] for e in steps) > 0
        assert all(pre > 0 and post > 0 and wait >= 0 and enq >= 0 for _, wait, pre, enq, post in timed)

def test_bad_topology_is_a_clear_error_before_any_rank(setup):
    t0 = time.monotonic()
    res = _generate(setup, "pd", ranks=(4, 3, 4), timeout=60)
    assert res.returncode == 2 and "ADP 3 does not divide world 4" in res.stderr
    res = _generate(setup, "pd", ranks=(4, 1, 4), timeout=60)   # ATP4 but the tiny model has 2 kv heads
    assert res.returncode == 2 and "must divide the attention heads" in res.stderr
    assert "Traceback" not in res.stderr and time.monotonic() - t0 < 60


def test_isolation_only_one_slot_stalls_on_the_real_model(setup):
    t0 = time.monotonic()
    res = _generate(setup, "pd", {"ordering": "isolation-only", "activation": "on"}, (4, 2, 4),
                    ["--slots", "1", "--cross-isolation", "--watchdog-bound", "2"], timeout=180)
    assert res.returncode == 3, res.stderr[-3000:]
    report = res.stderr[res.stderr.index("stall: no rank made progress"):]
    for k in range(4):
        assert f"rank {k}:" in report
    # the crossed pair: replica 0 holds D's DP-group AllGather, replica 1 P's model-wide AllReduce
    lines = {int(m.group(1)): m.group(2) for m in re.finditer(r"  rank (\d): (.*)", report)}
    assert "'running': ['D:" in lines[0] and "dp-allgather" in lines[0]
    assert "'running': ['P:" in lines[2] and "attn-allreduce" in lines[2]
    assert time.monotonic() - t0 < 150


def test_crossed_order_with_one_replica_stalls_in_the_atp_group(setup):
    # ATP2/ADP1 (two GPUs' worth): the sides are the local ranks; rank 0 holds D's ATP AllReduce,
    # rank 1 P's model-wide AllReduce over the same two ranks, on separate communicators.
    res = _generate(setup, "pd", {"ordering": "isolation-only", "activation": "on"}, (2, 1, 2),
                    ["--slots", "1", "--cross-isolation", "--watchdog-bound", "2"], timeout=180)
    assert res.returncode == 3, res.stderr[-3000:]
    report = res.stderr[res.stderr.index("stall: no rank made progress"):]
    lines = {int(m.group(1)): m.group(2) for m in re.finditer(r"  rank (\d): (.*)", report)}
    assert "'running': ['D:" in lines[0] and "atp-allreduce" in lines[0]
    assert "'running': ['P:" in lines[1] and "attn-allreduce" in lines[1]


def _http(url, body=None, method=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read().decode()


def test_serve_control_change_lands_at_the_same_step_on_every_rank(setup):
    model, _, d = setup
    log = d / "steplog"
    p = subprocess.Popen([sys.executable, "-m", "pdrollout.engine.cli", "serve", "--model", model, "--port", "0",
                          "--nproc", "4", "--adp", "2", "--ep", "4", "--step-log", str(log),
                          "--engine-config", json.dumps(ENGINE)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    killer = threading.Timer(300, lambda: os.killpg(p.pid, signal.SIGKILL))
    killer.start()
    try:
        url = None
        for line in p.stdout:
            if "ready on" in line:
                url = line.split()[-1]
                break
        assert url, p.stderr.read()[-3000:]
        _http(url + "/control", {**BUDGET, "span": 1, "ordering": "fine-grained", "activation": "on"}, "PUT")
        body = lambda i, n: {"input_ids": PROMPTS[i % 4], "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                                           "ignore_eos": True}}
        outs = {}
        ts = [threading.Thread(target=lambda i=i: outs.__setitem__(i, _http(url + "/generate", body(i, 40))))
              for i in range(3)]
        for t in ts:
            t.start()
        # the change lands while all three run, a few steps after they started under the old control
        deadline, started = time.monotonic() + 120, None
        while True:
            st = json.loads(_http(url + "/get_server_info"))["internal_states"][0]
            started = started if started is not None else (st["step"] if st["num_running_reqs"] == 3 else None)
            if started is not None and st["step"] >= started + 2:
                break
            assert time.monotonic() < deadline, f"the three requests never ran together: {st}"
            time.sleep(0.02)
        _http(url + "/control", {"span": 2, "ordering": "global-enqueue"}, "PUT")
        after = json.loads(_http(url + "/generate", body(3, 4)))   # steps after the change, surely
        for t in ts:
            t.join(120)
        assert len(outs) == 3 and len(after["output_ids"]) == 4
        metrics = _http(url + "/metrics")
        rounds = float(re.search(r"^pdrollout:turnstile_rounds_total (\S+)", metrics, re.M).group(1))
        rdv = float(re.search(r"^pdrollout:turnstile_rendezvous_seconds_count (\S+)", metrics, re.M).group(1))
        assert rounds > 0 and rdv >= 2 * rounds
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
    finally:
        killer.cancel()
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    logs = {r: [json.loads(x) for x in (log / f"rank{r}.jsonl").read_text().splitlines()] for r in range(4)}
    steps = {r: [(e["step"], e["control"]["ordering"], e["control"]["span"], e["rounds"]) for e in logs[r]]
             for r in logs}
    assert all(steps[r] == steps[0] for r in steps)            # same plan, same control, same rounds
    first = {r: next(e["step"] for e in logs[r] if e["control"]["ordering"] == "global-enqueue") for r in logs}
    assert len(set(first.values())) == 1 and first[0] > 0
    assert any(e["ordering"] == "fine-grained" and e["rounds"] > 0 for e in logs[0])


def test_deep_ep_backend_needs_cuda_a_clear_error_before_any_rank(setup):
    t0 = time.monotonic()
    res = _generate(setup, "pd", ranks=(2, 1, 2), extra=["--expert-backend", "deep_ep"], timeout=60)
    assert res.returncode == 2 and "--expert-backend deep_ep needs --device cuda" in res.stderr
    model, reqs, _ = setup   # one rank: no expert parallelism
    res = _run(["generate", "--model", model, "--requests", reqs, "--expert-backend", "deep_ep"], 60)
    assert res.returncode == 2 and "needs --nproc > 1" in res.stderr
    assert "Traceback" not in res.stderr and time.monotonic() - t0 < 60


def test_check_device():
    from pdrollout.engine.protocol.config import EngineConfig
    from pdrollout.engine.runtime.launcher import check_device
    from pdrollout.engine.runtime.options import RankOptions
    check_device(EngineConfig(model="m", device="cuda"), RankOptions(expert_backend="deep_ep"))
    check_device(EngineConfig(model="m", device="cpu"), RankOptions())
    with pytest.raises(ValueError, match="cpu or cuda"):
        check_device(EngineConfig(model="m", device="mps"), RankOptions())
    with pytest.raises(ValueError, match="must be one of"):
        check_device(EngineConfig(model="m", device="cuda"), RankOptions(expert_backend="nccl"))
    cuda, cpu = EngineConfig(model="m", device="cuda"), EngineConfig(model="m", device="cpu")
    check_device(cuda, RankOptions(sm_partition=8, nccl_ctas=8, skew_ms=20, gpu_timeline="/tmp/tl"))
    for flag, opts in (("--sm-partition", RankOptions(sm_partition=8)), ("--nccl-ctas", RankOptions(nccl_ctas=4)),
                       ("--gpu-timeline", RankOptions(gpu_timeline="/tmp/tl")),
                       ("--d-async", RankOptions(d_async=True))):
        with pytest.raises(ValueError, match=f"{flag} needs --device cuda"):
            check_device(cpu, opts)
    with pytest.raises(ValueError, match="--nccl-ctas must be >= 0"):
        check_device(cuda, RankOptions(nccl_ctas=-1))
    with pytest.raises(ValueError, match="--rank-skew-ms must be >= 0"):
        check_device(cpu, RankOptions(skew_ms=-1.0))


def test_gpu_knobs_on_cpu_are_a_clear_error_before_any_rank(setup):
    res = _generate(setup, "pd", ranks=(4, 2, 4), extra=["--sm-partition", "8"], timeout=60)
    assert res.returncode == 2 and "--sm-partition needs --device cuda" in res.stderr
    assert "Traceback" not in res.stderr


def test_random_weights_on_every_rank_need_only_config_json(setup):
    """A benchmark shape needs no checkpoint: every rank builds its shard from config.json, and a
    second run gives the same tokens (weights seeded per tensor name and shard)."""
    model, reqs, d = setup
    bare = d / "config-only"
    bare.mkdir(exist_ok=True)
    (bare / "config.json").write_text(open(f"{model}/config.json").read())
    args = ["generate", "--model", str(bare), "--requests", reqs, "--mode", "pd",
            "--engine-config", json.dumps({**ENGINE, "random_weights": True}),
            "--control", json.dumps({**BUDGET, **FINE}), "--nproc", "4", "--adp", "2", "--ep", "4"]
    first, second = _outputs(_run(args, 240)), _outputs(_run(args, 240))
    assert len(first) == len(PROMPTS) and all(len(o) == 5 for o in first)
    assert first == second


def _steps(log_dir, rank: int = 0) -> list[dict]:
    with open(os.path.join(log_dir, f"rank{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("ordering", ["fine-grained", "global-enqueue"])
def test_a_p_epoch_spans_d_steps_only_under_fine_grained(setup, ordering):
    """Fine-grained: a P epoch started beside D goes on under the next steps, each running its D in
    one round at P's next boundary, with no P planned meanwhile; its tokens arrive in the step that
    finds it finished, and the outputs equal one rank's. Global-enqueue joins P in its own step."""
    _, _, d = setup
    log = d / f"span-{ordering}"
    control = {"ordering": ordering, "activation": "on", "span": 1}
    got = _outputs(_generate(setup, "pd", control, (2, 1, 2), ["--step-log", str(log)]))
    assert got == _reference(setup, "pd")
    for rank in (0, 1):
        steps = _steps(log, rank)
        started = [s["step"] for s in steps if s["p_pending"]]
        finished = [s["p_done"] for s in steps if s["p_done"] is not None]
        if ordering == "global-enqueue":
            assert not started and not finished and all(s["p_flight"] is None for s in steps)
            continue
        assert started and finished == started, (started, finished)   # each epoch finishes once, in order
        during = [s for s in steps if s["p_flight"] is not None]
        assert all(s["prefill_tokens"] == 0 for s in during)          # no P planned while one is in flight
        assert any(s["decode_rows"] > 0 for s in during)              # D ran while the epoch was in flight
        for s in during:                                              # ... each in the epoch that is open
            assert max(x for x in started if x < s["step"]) == s["p_flight"]
    assert [(s["step"], s["p_flight"]) for s in _steps(log, 0)] == [(s["step"], s["p_flight"]) for s in _steps(log, 1)]


# D's collectives per MoE layer of the tiny model (3 layers, all MoE; docs/DISTRIBUTED.md):
# ATP1 only the packed expert all-to-all out and the one back; ATP2/ADP2 adds the attention
# AllReduce, the DP gather and scatter and the ATP gather around them.
D_PER_LAYER = {(4, 4, 4): 2, (2, 2, 2): 2, (4, 2, 4): 6}


def _cost_model():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "e2e"))
    import rank_cost
    return rank_cost


@pytest.mark.parametrize("ranks", [(4, 4, 4), (2, 2, 2), (4, 2, 4)], ids=lambda r: "-".join(map(str, r)))
def test_turnstile_and_d_collectives_from_the_step_log(setup, ranks):
    """ATP1 (uncrossed): P epochs beside D with no permit and no rendezvous, their end learnt from the
    step reports; D at two collectives a MoE layer. ATP2/ADP2 (crossed): the turnstile still orders
    every P epoch. Outputs equal one rank's either way. Every rank's D collectives and the bytes they
    sent, step by step, equal the cost model's (e2e/rank_cost.py) for that step's rows a replica."""
    model, _, d = setup
    log = d / f"collectives-{'-'.join(map(str, ranks))}"
    got = _outputs(_generate(setup, "pd", FINE, ranks, ["--step-log", str(log)]))
    assert got == _reference(setup, "pd")
    cfg = json.loads((d / "tiny" / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    crossed = ranks[0] // ranks[1] > 1
    rc = _cost_model()
    shape = rc.Shape(*ranks, cfg["hidden_size"], cfg["num_experts_per_tok"], layers, layers, elem=4)   # fp32
    logs = [_steps(log, r) for r in range(ranks[0])]
    atp = ranks[0] // ranks[1]
    beside, checked = [], 0
    for rank in range(ranks[0]):
        steps = logs[rank]
        with_d = [s for s in steps if s["decode_rows"] > 0]
        assert with_d and all(s["d_collectives"] == D_PER_LAYER[ranks] * layers for s in with_d), \
            [s["d_collectives"] for s in with_d]
        for i, s in enumerate(steps):   # the model from the step's rows a replica (its leaders' logs)
            rows = [logs[r * atp][i]["decode_rows"] for r in range(ranks[1])]
            want = rc.counted(rc.d_wire(shape, rank, rows)) if max(rows) else (0, 0)
            assert (s["d_collectives"], s["d_bytes"]) == want, (rank, s["step"], rows)
            checked += bool(max(rows))
        beside += [s for s in steps if s["p_flight"] is not None]
        if not crossed:
            assert all(s["rounds"] == 0 and not s["rendezvous_s"] and s["permits"] == 0 for s in steps)
        else:
            assert sum(s["rounds"] for s in steps) > 0 and sum(s["permits"] for s in steps) > 0
            assert all(s["rounds"] > 0 for s in with_d)         # every D step went through a round
    assert any(s["decode_rows"] > 0 for s in beside)   # an epoch spanned a step in which D ran
    assert checked >= 3 * ranks[0]   # several D steps a rank
    # the epoch's end lands at the same step on every rank
    firsts = [[(s["step"], s["p_flight"], s["p_done"]) for s in _steps(log, r)] for r in range(ranks[0])]
    assert all(f == firsts[0] for f in firsts)


PIECE_CASES = [((2, 2, 2), "pd", FINE), ((2, 2, 2), "normal", {}), ((2, 2, 2), "mixed", {}), ((4, 4, 4), "pd", FINE),
               ((4, 2, 4), "normal", {})]


@pytest.mark.parametrize("ranks,mode,control", PIECE_CASES, ids=[f"{'-'.join(map(str, c[0]))}-{c[1]}" for c in PIECE_CASES])
def test_p_pieces_on_several_ranks_at_atp1(setup, ranks, mode, control):
    """ATP1 on the token slots: every P forward replays P's pieces (eager pieces on CPU, the same
    buffers and padding as graphs) on every rank alike, each padded to the largest replica's bucket
    with padding sent to no peer; outputs equal one rank's without pieces. ATP2: P stays eager."""
    _, _, d = setup
    log = d / f"pieces-{'-'.join(map(str, ranks))}-{mode}"
    got = _outputs(_generate(setup, mode, control, ranks, ["--step-log", str(log)],
                             engine={"prefill_graph_tokens": 64}))
    assert got == _reference(setup, mode)
    counts = [[s["p_graph_replays"] for s in _steps(log, r)] for r in range(ranks[0])]
    if ranks[0] // ranks[1] > 1:
        assert all(c is None for per in counts for c in per)
        return
    # a P epoch's thread ends on each rank's own time (the log reads the count mid-epoch): the totals match
    assert counts[0][-1] > 0 and all(per[-1] == counts[0][-1] for per in counts), counts
