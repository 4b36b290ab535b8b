"""The multi-rank engine under chaos: a real `pdrollout serve --nproc 2` on CPU (tiny model, pd,
fine-grained turnstile rounds), requests in flight (streaming and not, plus a feeder that keeps P
epochs coming), then one fault per run:

* SIGKILL of the worker rank mid-round               -> exit 4 (peer lost)
* SIGSTOP of the worker rank past the watchdog bound -> exit 4 (peer lost: its heartbeat stopped)
* a rank's step-log disk full (a 64 KiB tmpfs we mount) -> exit 1 (error), the same on every rank
* loss on the ranks' links (iptables in a network namespace of our own; no netem here)
                                                     -> the ranks carry on (TCP retransmits)

Each must end (or carry on) within a bound with the documented code, answer every in-flight
request (an abort that says why, or a closed connection: never a hang) and leave no process of
its tree behind. The per-fault table (code, time to exit, what the client saw) is printed in pytest's terminal
summary (tests/conftest.py), so CI's log has it; docs/DISTRIBUTED.md, "Chaos", keeps a run's.
"""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import time

import pytest

from pdrollout.engine.protocol.exits import EXIT_ERROR, EXIT_PEER_LOST, name as exit_name
from procs import BOUND_S, CHAOS_TABLE, InFlight, Served, in_group, mid_round, rank_pids, serve_args, wait_gone

pytestmark = pytest.mark.timeout(600)
LOST_S = 5.0          # a silent peer is lost after max(watchdog bound / 2, 5 s)
EXIT_WITHIN_S = LOST_S + 15.0   # the verdict, the exit hooks' grace (2 s, in-flight answers), reaping


def _end(srv: Served, flight: InFlight, fault: str, expected: int, t_fault: float, tree: list[int]) -> dict:
    """The server's code and time to exit, every process of its tree gone, every request answered."""
    try:
        code = srv.proc.wait(EXIT_WITHIN_S + 10)
    except subprocess.TimeoutExpired:
        srv.kill()
        pytest.fail(f"{fault}: the server did not exit within {EXIT_WITHIN_S + 10:.0f}s (a hang)\n{srv.tail()}")
    took = time.monotonic() - t_fault
    left = wait_gone(tree, 5.0)
    gone = time.monotonic() - t_fault
    hung = flight.join(10.0)
    row = {"fault": fault, "expected": expected, "code": code, "exit_s": round(took, 1),
           "tree_gone_s": round(gone, 1), "client": flight.outcomes}
    CHAOS_TABLE.append(row)
    print(f"\nchaos: {fault}: exit {code} ({exit_name(code)}) after {took:.1f}s, tree gone after {gone:.1f}s; "
          f"client: {flight.outcomes}", flush=True)
    assert code == expected, f"{fault}: exit {code} ({exit_name(code)}), expected {expected}\n{srv.tail()}"
    assert took <= EXIT_WITHIN_S, f"{fault}: exit after {took:.1f}s, bound {EXIT_WITHIN_S}s\n{srv.tail()}"
    assert not left and not in_group(srv.pid), f"{fault}: processes outlived the server: {left or in_group(srv.pid)}"
    assert not hung, f"{fault}: requests still open after the server exited: {hung}"
    for kind in ("generate", "stream"):
        how, detail = flight.outcomes[kind]
        assert how != "hung", f"{fault}: {kind} hung: {detail}"
        assert "finish length" not in how, f"{fault}: {kind} completed although the group failed: {how}"
    return row


@pytest.fixture
def served(tiny_model, tmp_path):
    made: list[Served] = []

    def start(*extra: str, prefix=None) -> Served:
        made.append(Served(serve_args(tiny_model, *extra), tmp_path / f"serve{len(made)}.log", prefix=prefix))
        return made[-1]
    yield start
    for s in made:
        s.kill()


def test_sigkill_of_a_rank_mid_round_ends_the_group_with_peer_lost(served):
    srv = served()
    flight = InFlight(srv.url)
    mid_round(srv, flight)
    tree, ranks = srv.tree(), rank_pids(srv.pid)
    assert len(ranks) == 1, f"expected one spawned worker rank, found {ranks}"
    t0 = time.monotonic()
    os.kill(ranks[0], signal.SIGKILL)
    _end(srv, flight, "SIGKILL of rank 1 mid-round", EXIT_PEER_LOST, t0, tree)
    assert "(peer lost)" in srv.tail()


def test_sigstop_of_a_rank_past_the_watchdog_bound_ends_the_group_with_peer_lost(served):
    srv = served()
    flight = InFlight(srv.url)
    mid_round(srv, flight)
    tree, ranks = srv.tree(), rank_pids(srv.pid)
    t0 = time.monotonic()
    os.kill(ranks[0], signal.SIGSTOP)   # never continued: the launcher must take it down stopped
    _end(srv, flight, f"SIGSTOP of rank 1 (bound {BOUND_S:.0f}s)", EXIT_PEER_LOST, t0, tree)
    assert "no heartbeat" in srv.tail(), srv.tail()


def _mount_tmpfs(path, size: str) -> None:
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:   # a full disk is a required fault: never skipped
        pytest.fail(f"cannot mount a tmpfs for the full-disk fault (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")


def _fill(path) -> int:
    """Writes a file into `path` until its filesystem is full; returns the bytes written."""
    n = 0
    with open(path / "filler", "wb", buffering=0) as f:
        while True:
            try:
                n += f.write(b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                return n


@pytest.mark.parametrize("rank", [0, 1])
def test_full_disk_for_a_step_log_ends_every_rank_with_error(served, tmp_path, rank):
    """Only `rank`'s step log lives on the small tmpfs (a symlink from the step-log directory), so
    the rank that fails first is known: rank 0 fails its own step; rank 1's error must reach rank 0
    as the group's code (1), not as a lost peer (4)."""
    disk, logs = tmp_path / "disk", tmp_path / "steplogs"
    _mount_tmpfs(disk, "64k")
    logs.mkdir()
    (logs / f"rank{rank}.jsonl").symlink_to(disk / f"rank{rank}.jsonl")
    try:
        srv = served("--step-log", str(logs))
        flight = InFlight(srv.url)
        mid_round(srv, flight)
        tree = srv.tree()
        t0 = time.monotonic()
        _fill(disk)
        _end(srv, flight, f"rank {rank}'s step-log disk full (64 KiB tmpfs)", EXIT_ERROR, t0, tree)
        tail = srv.tail()
        assert f"StepLogError: rank {rank}: step log" in tail and "No space left on device" in tail, tail
        said = flight.outcomes["generate"][1]   # the client is told the cause, whichever rank had it
        assert f"rank {rank}: step log" in said and "No space left on device" in said, said
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
