"""Shared fixtures: small random Qwen3-MoE checkpoints written by our own `checkpoint` module."""
from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest

# One OpenMP thread a process, set before torch loads so every worker, server and rank inherits it:
# the suite runs two workers on two cores, each beside its own servers, and a process of more threads
# than its share of the cores spins at every op's barrier while the other runs (two bench tests side
# by side took 303 s each with torch's default of one thread a core, 26 s with one; README).
os.environ["OMP_NUM_THREADS"] = "1"

import checkout_guard  # noqa: E402

checkout_guard.check(Path(__file__).resolve().parent.parent)

import procs  # noqa: E402

from pdrollout.engine.model.checkpoint import write_checkpoint  # noqa: E402
from pdrollout.engine.protocol.config import load_preset  # noqa: E402

TINY = load_preset("tiny")
pytest_plugins = ("lanes",)   # how `pytest -n N` splits the suite

# pytest names test modules `tests.<dir>.<file>`; rank processes start by spawn and unpickle their
# target by that name, so the repository root must be importable there too. Appended, not
# prepended: the root's `operator/` must never shadow the standard library's `operator`.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)


def tiny_config(**overrides) -> dict:
    cfg = copy.deepcopy(TINY)
    cfg.update(overrides)
    return cfg


def tiny_prompt_forward(backends, routes: list | None = None):
    """fp32 logits of a 9-token prompt through the `tiny` preset's random model (seed 1) on CPU with
    `backends`; `routes`: a list each MoE layer appends its top-k ids to."""
    import torch
    from pdrollout.engine.model.checkpoint import random_model
    from pdrollout.engine.model.kv_cache import KVCache
    from pdrollout.engine.protocol.config import ModelConfig
    from pdrollout.engine.runtime.batch import ForwardBatch, SeqSlice
    cfg = ModelConfig.from_dict(load_preset("tiny"))
    prompt = [(i * 37) % (cfg.vocab_size - 2) + 2 for i in range(9)]
    model = random_model(cfg, torch.device("cpu"), torch.float32, seed=1, backends=backends)
    n = len(prompt)
    kv = KVCache(cfg.num_hidden_layers, 1, n, model.model.layers[0].self_attn.kv_heads, cfg.head_dim,
                 torch.float32, "cpu")
    slots = torch.arange(n)
    batch = ForwardBatch(input_ids=torch.tensor(prompt), positions=torch.arange(n), slot_mapping=slots,
                         seqs=[SeqSlice(0, n, n, slots)], logits_indices=torch.arange(n), routes=routes)
    return model(batch, kv)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The `tiny` preset, per-expert layout (the layout of real Hub checkpoints)."""
    return write_checkpoint(TINY, tmp_path_factory.mktemp("tiny"), seed=0)


# ---- no test leaves a process behind ------------------------------------------------------
LEFTOVER_GRACE_S = 5.0
_TESTS = Path(__file__).resolve().parent
_FIXTURE_PIDS: set[int] = set()   # started by session/package/module/class fixtures: may outlive a test


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.scope == "function":
        yield
        return
    before = set(procs.descendants(os.getpid()))
    yield
    _FIXTURE_PIDS.update(set(procs.descendants(os.getpid())) - before)


@pytest.fixture(autouse=True)
def no_leftover_processes(request):
    """Fails a test that leaves a process it started running (after a grace of a few seconds for
    trees that are still on their way out), and kills what it left so later tests start clean.

    "Started by the test": a new descendant of pytest's process, or any process carrying the
    test's token in its environment (set while the test runs; an orphan that init adopted keeps
    it, procs.Leftovers). Processes of higher-scoped fixtures (module-scoped servers) are exempt
    with their whole trees: they are meant to outlive the test that first asked for them, and
    their own teardown ends them. multiprocessing's resource tracker lives with pytest itself and
    is exempt too. A process started with an environment of its own (not inheriting pytest's) that
    leaves pytest's tree is not seen.

    tests/operator is not checked: its session-scoped control plane daemonizes (init adopts it),
    and its tests restart session-long processes in place on purpose (the operator killed
    mid-reconcile and started again, the API server restarted), so a process started inside such
    a test is meant to outlive it; e2e/cluster/stop.sh and the fixtures' teardown end them."""
    if Path(request.node.path).resolve().is_relative_to(_TESTS / "operator"):
        yield
        return
    watch = procs.Leftovers(_FIXTURE_PIDS)
    yield
    left = procs.wait_gone(watch.stop(), LEFTOVER_GRACE_S)
    if left:
        what = [f"{p}: {procs.cmdline(p)[:200]}" for p in left]
        procs.kill_all(left)
        pytest.fail(f"the test left {len(left)} process(es) running after {LEFTOVER_GRACE_S:.0f}s:\n"
                    + "\n".join(what), pytrace=False)


_CHAOS_ROWS: list[dict] = []   # gathered from the reports: under xdist the rows are made in the workers


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.when == "teardown" and procs.CHAOS_TABLE:
        rep.user_properties.append(("chaos", list(procs.CHAOS_TABLE)))
        procs.CHAOS_TABLE.clear()
    return rep


def pytest_runtest_logreport(report):
    _CHAOS_ROWS.extend(rows for key, value in report.user_properties if key == "chaos" for rows in value)


# ---- free disk, so a CI log tells when the disk ran short ------------------------------------
_DISK: dict[str, list[float]] = {}   # path -> [start, lowest, last] GB free


def _watch_disk(paths: list[str]) -> None:
    import shutil
    import threading
    import time

    def sample():
        while True:
            for p in paths:
                gb = shutil.disk_usage(p).free / 1e9
                start, low, _ = _DISK.get(p, [gb, gb, gb])
                _DISK[p] = [start, min(low, gb), gb]
            time.sleep(5)

    threading.Thread(target=sample, daemon=True, name="disk-watch").start()


def pytest_configure(config):
    if not hasattr(config, "workerinput"):   # the controller (or a run without xdist) watches
        import tempfile
        cache = os.environ.get("PDROLLOUT_CACHE") or os.path.expanduser("~/.cache/pdrollout")
        paths = {os.stat(p).st_dev: p for p in (tempfile.gettempdir(), cache) if os.path.isdir(p)}
        _watch_disk(sorted(paths.values()))


def pytest_terminal_summary(terminalreporter):
    """Free disk over the run, and the chaos tests' table (fault, exit code, time to exit), so CI's
    log shows them."""
    tr = terminalreporter
    for p, (start, low, last) in sorted(_DISK.items()):
        tr.write_line(f"[pdrollout] free disk on {p}'s file system: {start:.1f} GB at the start, "
                      f"{low:.1f} GB at the lowest, {last:.1f} GB at the end")
    if not _CHAOS_ROWS:
        return
    tr.section("chaos: exit code and time to exit per fault")
    tr.write_line("| fault | expected | exit code | time to exit (s) | tree gone (s) | client saw |")
    tr.write_line("|---|---|---|---:|---:|---|")
    for r in _CHAOS_ROWS:
        client = "; ".join(f"{k}: {v[0]}" for k, v in sorted(r["client"].items()))
        tr.write_line(f"| {r['fault']} | {r['expected']} | {r['code']} | {r['exit_s']} | {r['tree_gone_s']} "
                      f"| {client} |")
