"""The group layout (file < env < flags) and the launch's exit codes for what cannot form a group:
a bad layout is a configuration error (2) before any process starts; a node whose peers never arrive
exits with the peer-lost code (4) naming who is missing, within its join bound. The join itself: a
rank joins only a store with its slot free (not a previous start's, still stopping under node 0's
name), and a node 0 stopped while joining closes its store at once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pdrollout.engine.protocol.exits import EXIT_CONFIG, EXIT_PEER_LOST, EXIT_STALL, exit_code, most_telling
from pdrollout.engine.protocol.layout import GroupLayout, LayoutError, resolve
from pod_launch import free_port


def test_file_then_env_then_flags(tmp_path):
    f = tmp_path / "rollout.json"
    f.write_text(json.dumps({"nodes": 2, "gpusPerNode": 4, "expertParallel": 8, "attentionDataParallel": 2,
                             "masterAddr": "r-0.r.ns.svc", "masterPort": 29500, "device": "cuda",
                             "expertBackend": "torch", "worldSize": 8, "rollout": "r"}))
    layout = resolve(env={"PDROLLOUT_ROLLOUT_INFO": str(f), "PDROLLOUT_NODE_RANK": "1"})
    assert (layout.world, layout.node_rank, list(layout.local_ranks)) == (8, 1, [4, 5, 6, 7])
    assert (layout.master_addr, layout.device, layout.topology.atp) == ("r-0.r.ns.svc", "cuda", 4)
    env = {"PDROLLOUT_ROLLOUT_INFO": str(f), "PDROLLOUT_NODE_RANK": "0", "PDROLLOUT_MASTER_PORT": "31000"}
    assert resolve(env=env).master_port == 31000                                  # env over the file
    assert resolve({"master_port": 32000}, env=env).master_port == 32000          # flags over env
    assert resolve({"layout": str(f), "node_rank": 1}, env={}).node_rank == 1     # --layout instead of env


def test_single_node_nproc_and_defaults():
    layout = resolve({"nproc": 4, "adp": 2, "ep": 4}, env={})
    assert (layout.nnodes, layout.nproc_per_node, layout.world, layout.device) == (1, 4, 4, "cpu")
    assert resolve({}, env={}) == GroupLayout()
    assert GroupLayout(**{"nnodes": 2, "nproc_per_node": 2, "master_addr": "h"}).to_file()["nodes"] == 2


@pytest.mark.parametrize("flags,env,message", [
    ({"nnodes": 2, "nproc_per_node": 2}, {}, "needs the master address"),
    ({"nnodes": 2, "node_rank": 2, "master_addr": "h"}, {}, "node rank 2 is outside 0..1"),
    ({"nproc": 6, "nnodes": 2, "nproc_per_node": 2, "master_addr": "h"}, {}, "--nproc 6 is the world size"),
    ({}, {"PDROLLOUT_NNODES": "two"}, "$PDROLLOUT_NNODES: nnodes must be an integer, got 'two'"),
    ({"nproc": 4, "adp": 3}, {}, "ADP 3 does not divide world 4"),
    ({"nnodes": 2, "master_addr": "h", "master_port": 0}, {}, "needs a fixed master port"),
    ({"device": "tpu"}, {}, "device must be one of cpu|cuda"),
    ({"expert_backend": "nccl"}, {}, "expert backend must be one of torch|deep_ep"),
])
def test_layouts_that_cannot_form_a_group_are_named(flags, env, message):
    with pytest.raises(LayoutError) as e:
        resolve(flags, env=env)
    assert message in str(e.value)


def test_layout_file_errors_name_the_file(tmp_path):
    with pytest.raises(LayoutError, match="layout file .*missing.json: No such file"):
        resolve({"layout": str(tmp_path / "missing.json")}, env={})
    bad = tmp_path / "bad.json"
    bad.write_text("{nodes: 2")
    with pytest.raises(LayoutError, match="not valid JSON"):
        resolve({"layout": str(bad)}, env={})


def test_exit_codes_the_stall_wins():
    from pdrollout.engine.runtime.watchdog import StallError
    gone = RuntimeError("[gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:1: Connection reset by peer")
    assert exit_code(gone) == EXIT_PEER_LOST
    assert exit_code(gone, stall=True) == EXIT_STALL            # the stall report wins over its consequences
    assert exit_code(StallError("x", {}, 1.0)) == EXIT_STALL
    assert exit_code(LayoutError("x")) == EXIT_CONFIG and exit_code(ValueError("x")) == 1
    assert most_telling([None, EXIT_PEER_LOST, EXIT_STALL]) == EXIT_STALL
    assert most_telling([0, -9]) == EXIT_PEER_LOST and most_telling([0, 0]) == 0


def _serve(tiny_model, *extra, timeout=120):
    p = subprocess.Popen([sys.executable, "-m", "pdrollout.engine.cli", "serve", "--model", str(tiny_model),
                          "--host", "127.0.0.1", "--port", "0", *extra], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"serve ran past {timeout}s:\n{err[-3000:]}")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)   # no rank outlives the test
        except ProcessLookupError:
            pass
    return p.returncode, err


def test_bad_layout_is_a_configuration_error_before_any_rank(tiny_model):
    t0 = time.monotonic()
    code, err = _serve(tiny_model, "--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", timeout=60)
    assert code == EXIT_CONFIG and "node rank 2 is outside 0..1" in err and "Traceback" not in err
    code, err = _serve(tiny_model, "--nproc", "4", "--adp", "1", timeout=60)   # tiny: 2 kv heads, not ATP4
    assert code == EXIT_CONFIG and "must divide the attention heads" in err
    assert time.monotonic() - t0 < 60


def test_node_0_alone_names_the_missing_node(tiny_model):
    t0 = time.monotonic()
    code, err = _serve(tiny_model, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "0", "--adp", "2",
                       "--ep", "4", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                       "--join-timeout", "15")   # node 0's own spawned rank joins well inside it, even on a loaded machine
    assert code == EXIT_PEER_LOST, err[-3000:]
    assert "GroupJoinTimeout" in err and "ranks [2, 3] (node 1) did not join within 15s; 2/4 joined" in err
    assert time.monotonic() - t0 < 60


def test_worker_node_without_node_0_gives_up_within_its_bound(tiny_model):
    t0 = time.monotonic()
    code, err = _serve(tiny_model, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "1", "--adp", "2",
                       "--ep", "4", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                       "--join-timeout", "4")
    assert code == EXIT_PEER_LOST, err[-3000:]
    assert "node 0's store at 127.0.0.1" in err and "not reachable within 4s" in err
    assert "ranks ended 2: 4 (peer lost), 3: 4 (peer lost); exit 4 (peer lost)" in err
    assert time.monotonic() - t0 < 60


def _master(port: int):
    import datetime
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", port, 4, True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))


def test_a_rank_joins_only_a_store_with_its_slot_free():
    """Node 0's stable name leads to the previous node 0 while it is still stopping, its store holding
    every slot of the group it formed. A rank of the next start must not join that group (it would form
    a group with ranks on their way out); it connects again until the next node 0's store is up, and
    joins there. Each slot is taken once per store."""
    import socket
    import threading
    from pdrollout.engine.runtime.node import SlotTaken, claim, connect_and_join
    port = free_port()
    layout = GroupLayout(nnodes=2, nproc_per_node=2, adp=2, ep=4, master_addr="127.0.0.1", master_port=port,
                         join_timeout_s=60)
    previous = _master(port)
    for r in range(4):
        claim(previous, r)                     # the previous start's group, formed
    held = previous.get("join/2")
    said, joined = [], []
    t = threading.Thread(target=lambda: joined.append(connect_and_join(layout, 2, log=said.append)), daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not said:
        assert time.monotonic() < deadline, "rank 2 never reached the previous store"
        time.sleep(0.05)
    time.sleep(1.5)                            # a few more tries: it keeps away
    assert previous.get("join/2") == held and not joined
    del previous                               # the previous node 0 is gone; the next one starts
    store = _master(port)
    for r in (0, 1, 3):
        claim(store, r)
    t.join(30)
    assert joined, "rank 2 did not join the next start's store"
    assert store.get("join/2").decode().startswith(f"{socket.gethostname()}:{os.getpid()}:")
    assert len(said) == 1 and "already has rank 2" in said[0] and "another start of the group" in said[0], said
    with pytest.raises(SlotTaken, match="rank 2's slot in node 0's store is held by"):
        claim(store, 2)


def test_a_store_of_another_start_that_stays_ends_the_join_within_its_bound():
    from pdrollout.engine.protocol.exits import GroupJoinTimeout
    from pdrollout.engine.runtime.node import claim, connect_and_join
    port = free_port()
    previous = _master(port)
    claim(previous, 3)
    layout = GroupLayout(nnodes=2, nproc_per_node=2, adp=2, ep=4, master_addr="127.0.0.1", master_port=port,
                         join_timeout_s=2)
    t0 = time.monotonic()
    with pytest.raises(GroupJoinTimeout, match="already has rank 3 .*: another start of the group, still after 2s"):
        connect_and_join(layout, 3, log=lambda _: None)
    assert time.monotonic() - t0 < 10
    assert exit_code(GroupJoinTimeout("x")) == EXIT_PEER_LOST


def test_node_0_stopped_while_joining_closes_its_store_at_once(tiny_model, tmp_path):
    """A node 0 deleted while its group forms (a group restart) must not keep its store open: the next
    start's other nodes reach node 0 by the same name and would join the group it never completes."""
    import socket
    port, log = free_port(), tmp_path / "node0.log"

    def store_up() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "pdrollout.engine.cli", "serve", "--model", str(tiny_model),
                              "--host", "127.0.0.1", "--port", "0", "--nnodes", "2", "--nproc-per-node", "2",
                              "--node-rank", "0", "--adp", "2", "--ep", "4", "--master-addr", "127.0.0.1",
                              "--master-port", str(port), "--join-timeout", "120"],
                             stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not store_up():
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(1.0)                        # its local rank joins; node 1's never come
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        code = p.wait(30)
        took = time.monotonic() - t0
        assert code == 0, log.read_text()[-3000:]
        assert took < 5.0 and not store_up(), f"node 0 left {took:.1f}s after SIGTERM"
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)   # no rank outlives the test
        except ProcessLookupError:
            pass


def test_node_0_fails_its_join_at_once_when_a_rank_it_started_exits():
    """A rank node 0 spawned that dies before joining (a bad shim re-running `serve` in it, an import
    error) ends node 0's join at once with its code, instead of waiting out the join bound while
    `pdrollout bench` waits for /health."""
    import multiprocessing as mp
    from pdrollout.engine.protocol.exits import PeerLostError
    from pdrollout.engine.runtime.local_ranks import LocalRanks
    from pdrollout.engine.runtime.node import join
    port = free_port()
    layout = GroupLayout(nproc_per_node=2, adp=1, ep=2, master_addr="127.0.0.1", master_port=port,
                         join_timeout_s=300)
    store = _master(port)
    local = LocalRanks(layout)
    local.procs[1] = mp.get_context("spawn").Process(target=os._exit, args=(EXIT_CONFIG,))
    local.procs[1].start()
    t0 = time.monotonic()
    with pytest.raises(PeerLostError, match=r"rank 0: rank 1, started here, exited \(bad configuration\) "
                                            r"before the group formed; 1/2 joined"):
        join(store, layout, 0, ended=local.first_exit)
    assert time.monotonic() - t0 < 10
    assert exit_code(PeerLostError("x")) == EXIT_PEER_LOST
