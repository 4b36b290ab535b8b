"""Process hygiene: `pdrollout serve --nproc 2` and `pdrollout bench` (with the server it starts)
take their whole process trees down on SIGTERM and on SIGINT, within a bound, with requests in
flight; also a SIGTERM while the group is still joining, and Ctrl-C (SIGINT to the whole
foreground process group, ranks included). tests/conftest.py's `no_leftover_processes` checks
every test for what it left; these check the trees of the commands themselves."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import httpx
import pytest

from pdrollout.engine.protocol.exits import EXIT_OK, EXIT_PEER_LOST
from procs import (PDROLLOUT, InFlight, Served, descendants, in_group, mid_round, rank_pids, serve_args,
                   wait_gone)

pytestmark = pytest.mark.timeout(600)
DRAIN_S = 5.0                     # --drain-timeout of _args: in-flight requests are aborted after it
STOP_WITHIN_S = DRAIN_S + 15.0    # drain, the stop plan to every rank, reaping


def _stopped(proc: subprocess.Popen, tree: list[int], t0: float, within: float, what: str,
             tail) -> tuple[int, float]:
    try:
        code = proc.wait(within + 10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what}: still running {within + 10:.0f}s after the signal\n{tail()}")
    left = wait_gone(tree, 5.0)
    took = time.monotonic() - t0
    print(f"\nhygiene: {what}: exit {code}, tree gone after {took:.1f}s", flush=True)
    assert not left, f"{what}: processes outlived it: {left}\n{tail()}"
    assert took <= within, f"{what}: took {took:.1f}s, bound {within}s"
    return code, took


@pytest.fixture
def served(tiny_model, tmp_path):
    made: list[Served] = []

    def start(**kw) -> Served:
        made.append(Served(serve_args(tiny_model), tmp_path / f"serve{len(made)}.log", **kw))
        return made[-1]
    yield start
    for s in made:
        s.kill()


def test_ranks_fork_from_one_server_with_their_launchers_environment(tmp_path, monkeypatch):
    """local_ranks.start_process: every rank of a launcher forks from one server that imported torch before
    any rank asked (the rank imports nothing of it again), and each rank gets the launcher's
    environment of the moment it starts, not the server's (started with the first rank)."""
    from pdrollout.engine.runtime.local_ranks import start_process
    from ranks import report_start
    seen = []
    for value in ("first", "second"):
        monkeypatch.setenv("PDROLLOUT_TEST_START", value)
        out = tmp_path / f"{value}.txt"
        p = start_process(report_start, (str(out), "PDROLLOUT_TEST_START"), f"start-{value}")
        p.join(60)
        assert p.exitcode == 0 and out.exists(), p.exitcode
        seen.append(out.read_text().split())
    (server1, preloaded1, env1), (server2, preloaded2, env2) = seen
    assert server1 == server2 != str(os.getpid()), seen
    assert "multiprocessing.forkserver" in open(f"/proc/{server1}/cmdline").read(), seen
    assert preloaded1 == preloaded2 == "True", seen
    assert (env1, env2) == ("first", "second"), seen


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_takes_its_tree_down_on_a_signal(served, sig):
    srv = served()
    flight = InFlight(srv.url)
    mid_round(srv, flight)
    tree = srv.tree()
    assert len(rank_pids(srv.pid)) == 1
    t0 = time.monotonic()
    os.kill(srv.pid, sig)
    code, _ = _stopped(srv.proc, tree, t0, STOP_WITHIN_S, f"serve on {sig.name}", srv.tail)
    assert code == EXIT_OK, srv.tail()
    assert not flight.join(10.0), f"requests hung: {flight.outcomes}"
    for kind in ("generate", "stream"):   # drained, then aborted: an answer either way
        assert flight.outcomes[kind][0].startswith(("HTTP 200", "stream ended")), flight.outcomes


def test_serve_takes_its_tree_down_on_ctrl_c(served):
    """Ctrl-C in a terminal: SIGINT to every process of the foreground group, the ranks too."""
    srv = served()
    flight = InFlight(srv.url)
    mid_round(srv, flight)
    tree = srv.tree()
    t0 = time.monotonic()
    os.killpg(srv.pid, signal.SIGINT)
    code, _ = _stopped(srv.proc, tree, t0, STOP_WITHIN_S, "serve on Ctrl-C (SIGINT to the group)", srv.tail)
    assert code == EXIT_OK, srv.tail()
    assert not flight.join(10.0), f"requests hung: {flight.outcomes}"


def test_serve_takes_its_tree_down_on_sigterm_while_the_group_joins(served):
    srv = served(wait_ready=False)
    deadline = time.monotonic() + 120
    while not rank_pids(srv.pid):   # the worker rank is spawned: the group is forming
        assert time.monotonic() < deadline and srv.proc.poll() is None, srv.tail()
        time.sleep(0.05)
    tree = srv.tree()
    t0 = time.monotonic()
    os.kill(srv.pid, signal.SIGTERM)
    code, _ = _stopped(srv.proc, tree, t0, 15.0, "serve on SIGTERM while joining", srv.tail)
    assert code == EXIT_OK, srv.tail()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_bench_takes_its_server_down_on_a_signal(tiny_model, tmp_path, sig):
    out = tmp_path / "bench"
    serve_args = [f"--serve-arg={a}" for a in ("--nproc", "2", "--adp", "1", "--ep", "2")]
    proc = subprocess.Popen([*PDROLLOUT, "bench", "--model", str(tiny_model), "--modes", "pd", "--preset", "tiny",
                             "--device", "cpu", "--out", str(out), "--no-progress", *serve_args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log = out / "server-pd.log"
    tail = lambda: (log.read_text() if log.exists() else "(no server log)")[-4000:]
    try:
        deadline = time.monotonic() + 180
        while not (log.exists() and "ready on http://" in log.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, f"bench's server never ready\n{tail()}"
            time.sleep(0.1)
        url = re.search(r"ready on (http://\S+)", log.read_text()).group(1)
        while httpx.get(url + "/get_server_info", timeout=10).json()["in_flight"] == 0:   # the replay is under way
            assert time.monotonic() < deadline and proc.poll() is None, f"no request reached the server\n{tail()}"
            time.sleep(0.05)
        tree = [proc.pid, *descendants(proc.pid)]
        assert any(" serve " in open(f"/proc/{p}/cmdline").read().replace("\0", " ") for p in tree[1:]), tree
        t0 = time.monotonic()
        os.kill(proc.pid, sig)
        code, _ = _stopped(proc, tree, t0, 2.0 + 15.0, f"bench on {sig.name}", tail)
        assert code == 128 + sig, f"bench exit {code}\n{proc.stdout.read()[-3000:]}"
        assert "bench interrupted" in proc.stdout.read()
    finally:
        for p in in_group(proc.pid):
            os.kill(p, signal.SIGKILL)
        proc.wait(10)


@pytest.fixture
def two_nodes(tiny_model, tmp_path):
    """One engine over two "nodes" on loopback (one rank each, node 0 serves the API): the CLI's
    multi-node flags, each node its own process tree."""
    from pod_launch import free_port
    store, health = free_port(), free_port()
    made: list[Served] = []

    def node(k: int) -> Served:
        args = serve_args(tiny_model, "--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "1",
                          "--master-addr", "127.0.0.1", "--master-port", str(store))
        args = _without(args, "--nproc")   # the world is nodes x local ranks here
        if k:
            args += ["--port", str(health)]
        made.append(Served(args, tmp_path / f"node{k}.log", wait_ready=not k))
        return made[-1]
    node1 = node(1)
    node0 = node(0)
    yield node0, node1
    for s in made:
        s.kill()


def _without(args: list[str], flag: str) -> list[str]:
    i = args.index(flag)
    return args[:i] + args[i + 2:]


def test_sigterm_to_node_0_stops_every_node(two_nodes):
    node0, node1 = two_nodes
    flight = InFlight(node0.url)
    mid_round(node0, flight)
    trees = node0.tree() + node1.tree()
    t0 = time.monotonic()
    os.kill(node0.pid, signal.SIGTERM)
    code0, _ = _stopped(node0.proc, trees, t0, STOP_WITHIN_S, "node 0 on SIGTERM (two nodes)",
                        lambda: node0.tail() + node1.tail())
    assert code0 == EXIT_OK and node1.proc.wait(5) == EXIT_OK, node1.tail()   # the stop plan reached node 1
    assert not flight.join(10.0), f"requests hung: {flight.outcomes}"


def test_sigterm_to_node_1_takes_its_ranks_and_ends_the_group(two_nodes):
    node0, node1 = two_nodes
    flight = InFlight(node0.url)
    mid_round(node0, flight)
    tree1, tree0 = node1.tree(), node0.tree()
    t0 = time.monotonic()
    os.kill(node1.pid, signal.SIGTERM)
    code1, _ = _stopped(node1.proc, tree1, t0, 10.0, "node 1 on SIGTERM", node1.tail)
    assert code1 == EXIT_OK, node1.tail()
    # node 0 lost its peer: the documented code, within the bound, nothing left behind
    code0, _ = _stopped(node0.proc, tree0, t0, 20.0, "node 0 after node 1 stopped", node0.tail)
    assert code0 == EXIT_PEER_LOST, node0.tail()
    assert not flight.join(10.0), f"requests hung: {flight.outcomes}"


def test_ranks_leave_when_node_1s_launcher_is_killed(two_nodes):
    """A launcher killed outright (SIGKILL, the OOM killer, a SIGTERM before its handlers) leaves no
    rank behind: each rank sees itself reparented and leaves with the lost-peer code. A rank left in a
    deleted pod ran until the pod's grace ended, joined the next group under node 0's stable name and
    took it down when killed (a second group restart on real kubelets: docs/OPERATOR.md)."""
    node0, node1 = two_nodes
    ranks1, tree0 = rank_pids(node1.pid), node0.tree()
    assert ranks1, node1.tail()
    t0 = time.monotonic()
    os.kill(node1.pid, signal.SIGKILL)
    left = wait_gone(ranks1, 5.0)
    assert not left, f"node 1's ranks {left} outlived their launcher by 5 s\n{node1.tail()}"
    print(f"\nhygiene: node 1's ranks gone {time.monotonic() - t0:.1f}s after its launcher's SIGKILL", flush=True)
    # each orphan leaves its last words through the pipe it shared with its launcher
    deadline = time.monotonic() + 3.0
    while (said := len(re.findall(r"\[rank \d+\] exit 4 \(.*\): LauncherGone", node1.tail()))) < len(ranks1) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert said == len(ranks1), node1.tail()
    code0, _ = _stopped(node0.proc, tree0, t0, 20.0, "node 0 after node 1's launcher was killed", node0.tail)
    assert code0 == EXIT_PEER_LOST, node0.tail()
