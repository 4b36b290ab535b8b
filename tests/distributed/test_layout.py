"""The group layout (file < env < flags) and the launch's exit codes for what cannot form a group:
a bad layout is a configuration error (2) before any process starts; a node whose peers never arrive
exits with the peer-lost code (4) naming who is missing, within its join bound."""
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
                       "--join-timeout", "4")
    assert code == EXIT_PEER_LOST, err[-3000:]
    assert "GroupJoinTimeout" in err and "ranks [2, 3] (node 1) did not join within 4s; 2/4 joined" in err
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
