"""The multi-rank engine under chaos: a real `pdrollout serve --nproc 2` on CPU (tiny model, pd,
fine-grained turnstile rounds), requests in flight (streaming and not, plus a feeder that keeps P
epochs coming), then one fault per run:

* SIGKILL of the worker rank mid-round               -> exit 4 (peer lost)
* SIGSTOP of the worker rank past the watchdog bound -> exit 4 (peer lost: its heartbeat stopped)
* SIGKILL of rank 0 (the server, the store's host)   -> the worker rank leaves by itself with 4
* a rank's step-log disk full (a 64 KiB tmpfs we mount) -> exit 1 (error), the same on every rank;
  on one rank while the server drains after SIGTERM -> exit 1 too (the stop does not hide it)
* 5% and 30% loss on the ranks' links (iptables in a network namespace of our own; no netem here)
                                                     -> the ranks carry on (TCP retransmits), or
                                                        end as a stall (3) or lost peer (4)

Each must end (or carry on) within a bound with the documented code, answer every in-flight
request (an abort that says why, or a closed connection: never a hang) and leave no process of
its tree behind. The per-fault table (code, time to exit, what the client saw) is printed in
pytest's terminal summary (tests/conftest.py), so CI's log has it; docs/DISTRIBUTED.md, "Chaos and
process hygiene", keeps a run's.
"""
from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest

from pdrollout.engine.protocol.exits import EXIT_ERROR, EXIT_PEER_LOST, EXIT_STALL, name as exit_name
from procs import (BOUND_S, CHAOS_TABLE, PDROLLOUT, InFlight, Served, descendants, in_group, kill_all, metric,
                   mid_round, prompt, rank_pids, serve_args, wait_gone)

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


def test_sigstop_of_a_rank_ends_the_group_when_no_one_reads_the_servers_stderr(tiny_model):
    """The server's output pipe lost its reader (the supervisor that read it died, as pytest's pump
    does when a run is killed): the watchdog's verdict must still end the group. Its thread used to
    die of a BrokenPipeError on the line before the exit, and the server then served on, forever,
    beside a stopped rank."""
    proc = subprocess.Popen([*PDROLLOUT, "serve", *serve_args(tiny_model)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    late = threading.Timer(240.0, proc.kill)   # a server that never gets ready ends the read below
    late.start()
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "ready on http://" in line:
                break
        assert "ready on http://" in "".join(seen[-1:]), "".join(seen)[-3000:]
        late.cancel()
        proc.stdout.close()   # no reader from here on: every write of the server's tree fails
        tree, ranks = [proc.pid, *descendants(proc.pid)], rank_pids(proc.pid)
        assert len(ranks) == 1, f"expected one spawned worker rank, found {ranks}"
        t0 = time.monotonic()
        os.kill(ranks[0], signal.SIGSTOP)
        try:
            code = proc.wait(EXIT_WITHIN_S + 10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit within {EXIT_WITHIN_S + 10:.0f}s of a stopped rank with its "
                        f"stderr unread (a hang)")
        took = time.monotonic() - t0
        print(f"\nchaos: SIGSTOP of rank 1, stderr unread: exit {code} ({exit_name(code)}) after {took:.1f}s", flush=True)
        assert code == EXIT_PEER_LOST, f"exit {code} ({exit_name(code)}), expected {EXIT_PEER_LOST}"
        assert took <= EXIT_WITHIN_S, f"exit after {took:.1f}s, bound {EXIT_WITHIN_S}s"
        left = wait_gone(tree, 5.0)
        assert not left and not in_group(proc.pid), f"processes outlived the server: {left or in_group(proc.pid)}"
    finally:
        late.cancel()
        kill_all(in_group(proc.pid))
        proc.wait(10)


def test_sigkill_of_rank_0_leaves_no_rank_behind(served):
    """The server itself (rank 0, the group's store) killed: nobody can report an exit code for
    the group, but its rank must notice the store is gone and leave within the bound, and every
    client sees its connection closed."""
    srv = served()
    flight = InFlight(srv.url)
    mid_round(srv, flight)
    ranks = rank_pids(srv.pid)
    t0 = time.monotonic()
    os.kill(srv.pid, signal.SIGKILL)
    left = wait_gone(ranks, EXIT_WITHIN_S)
    took = time.monotonic() - t0
    hung = flight.join(10.0)
    deadline = time.monotonic() + 3.0   # its own last words (nobody can wait for it), through the pipe
    while not (said := re.search(r"\[rank 1\] exit (-?\d+)", srv.tail())) and time.monotonic() < deadline:
        time.sleep(0.05)
    CHAOS_TABLE.append({"fault": "SIGKILL of rank 0 (the server, the group's store)", "expected": 4,
                        "code": f"rank 1: {said.group(1) if said else '?'}", "exit_s": round(took, 1), "tree_gone_s": round(took, 1),
                        "client": flight.outcomes})
    assert not left, f"rank processes outlived rank 0 by {EXIT_WITHIN_S}s: {left}\n{srv.tail()}"
    assert not hung, f"requests still open: {hung}"
    for kind in ("generate", "stream"):
        assert flight.outcomes[kind][0].startswith("connection closed"), flight.outcomes
    assert said and int(said.group(1)) == EXIT_PEER_LOST, srv.tail()


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


def test_an_engine_that_fails_while_draining_after_sigterm_exits_with_its_code(served, tmp_path):
    """SIGTERM starts a graceful drain and the engine fails during it (its step log's disk fills):
    the server exits with the failure's code and says so, not 0 as if the stop had been clean. One
    rank, so no watchdog's forced exit can decide the code first; on two ranks 30 % loss once held a
    heartbeat past the bound just as a stop began, and the drain's first command raised instead."""
    disk, logs = tmp_path / "disk", tmp_path / "steplogs"
    _mount_tmpfs(disk, "64k")
    logs.mkdir()
    (logs / "rank0.jsonl").symlink_to(disk / "rank0.jsonl")
    try:
        srv = served("--nproc", "1", "--ep", "1", "--step-log", str(logs), "--drain-timeout", "60")
        flight = InFlight(srv.url)
        deadline = time.monotonic() + 120
        while metric(srv.url, "pdrollout:generation_tokens_total") < 10 and time.monotonic() < deadline:
            time.sleep(0.1)
        tree = srv.tree()
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)   # the drain waits up to 60 s for the long requests
        time.sleep(0.5)
        _fill(disk)
        _end(srv, flight, "step-log disk full while draining after SIGTERM (one rank)", EXIT_ERROR, t0, tree)
        tail = srv.tail()
        assert "failed while shutting down" in tail and "No space left on device" in tail, tail
        assert "pdrollout serve: exit 1 (error)" in tail and "EngineUnavailable" not in tail, tail
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


# ---- loss on the ranks' links ----------------------------------------------------------------
# No sch_netem in this kernel ("Specified qdisc kind is unknown"), so no delay qdisc: loss is
# iptables' `statistic` match dropping a random share of every packet on the loopback of a network
# namespace of our own, where the ranks (gloo pairs and the group's store) talk. The client reaches
# the server over a veth pair, which no rule touches.
LOSS_WINDOW_S = 15.0
HEALED_ANSWER_S = 45.0   # TCP's backed-off retransmit timers fire, then the answer's remaining rounds


def _sh(*cmd: str) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:   # a required fault: never skipped
        pytest.fail(f"link-loss setup: `{' '.join(cmd)}` failed (needs root, iproute2, iptables): {r.stderr.strip()}")
    return r.stdout


@pytest.fixture
def netns():
    """A network namespace with lo up and a veth pair to it; (name, the namespace's address)."""
    tag = f"pdrc{os.getpid() % 100000}"
    # 10.200-239: clear of the real-node cluster's 10.244 pods and 10.250 nodes (tests/lanes.py runs both at once)
    net = f"10.{200 + os.getpid() % 40}.{os.getpid() % 250}"
    host, inner = f"{net}.1", f"{net}.2"
    _sh("ip", "netns", "add", tag)
    try:
        _sh("ip", "link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b")
        _sh("ip", "link", "set", f"{tag}b", "netns", tag)
        _sh("ip", "addr", "add", f"{host}/30", "dev", f"{tag}a")
        _sh("ip", "link", "set", f"{tag}a", "up")
        for cmd in (("ip", "addr", "add", f"{inner}/30", "dev", f"{tag}b"), ("ip", "link", "set", f"{tag}b", "up"),
                    ("ip", "link", "set", "lo", "up")):
            _sh("ip", "netns", "exec", tag, *cmd)
        yield tag, inner
    finally:
        subprocess.run(["ip", "link", "del", f"{tag}a"], capture_output=True)
        subprocess.run(["ip", "netns", "del", tag], capture_output=True)


class Aborted(Exception):
    """A request answered with an abort (the group failed): its message."""


def _greedy(url: str, i: int) -> list[int]:
    r = httpx.post(url + "/generate", json={"input_ids": prompt(i, 24), "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}, timeout=60)
    if r.status_code == 503:   # the group failed and the server says so until it exits
        raise Aborted(f"HTTP 503: {r.text[:300]}")
    fr = r.json()["meta_info"]["finish_reason"]
    if fr["type"] == "abort":
        raise Aborted(fr.get("message", ""))
    assert r.status_code == 200 and fr["type"] == "length", r.text
    return r.json()["output_ids"]


@pytest.mark.parametrize("loss", [0.05, 0.3])
def test_loss_on_the_ranks_links_is_carried_or_ends_with_a_documented_code(served, netns, loss):
    """A share of the packets between the ranks dropped for 15 s while requests run, then the links
    heal: TCP retransmits, so the ranks carry on and greedy answers equal the ones before the loss;
    if the retransmits outlast the watchdog, the group must end as a stall (3) or a lost peer (4),
    within the bound, with nothing left behind. An answer slowed past the window is neither: it must
    arrive once the links heal."""
    tag, addr = netns
    srv = served("--host", addr, prefix=["ip", "netns", "exec", tag])
    t_ref = time.monotonic()
    reference = {i: _greedy(srv.url, i) for i in range(3)}
    t_ref = (time.monotonic() - t_ref) / 3
    tree = srv.tree()
    rounds0 = metric(srv.url, "pdrollout:turnstile_rounds_total")
    rule = ("-i", "lo", "-m", "statistic", "--mode", "random", "--probability", str(loss), "-j", "DROP")
    _sh("ip", "netns", "exec", tag, "iptables", "-A", "INPUT", *rule)
    t0 = time.monotonic()
    got: dict = {"answers": 0, "failure": None, "t_fail": None}

    def client() -> None:
        try:
            while time.monotonic() - t0 < LOSS_WINDOW_S and srv.proc.poll() is None:
                i = got["answers"] % 3
                got["wrong"] = _greedy(srv.url, i) != reference[i]
                if got["wrong"]:
                    return
                got["answers"] += 1
        except (httpx.HTTPError, Aborted) as e:
            got["failure"], got["t_fail"] = e, time.monotonic()

    runner = threading.Thread(target=client, daemon=True)
    runner.start()
    runner.join(LOSS_WINDOW_S)
    stats = _sh("ip", "netns", "exec", tag, "iptables", "-L", "INPUT", "-v", "-x", "-n")
    dropped = int(next(line.split()[0] for line in stats.splitlines() if "DROP" in line))
    # the links heal; under continuing 30 % loss TCP's backoff alone can hold an answer, or the stop
    # plan's broadcast and barrier, past any bound (seen: 30 s and more)
    _sh("ip", "netns", "exec", tag, "iptables", "-D", "INPUT", *rule)
    t_heal = time.monotonic()
    runner.join(HEALED_ANSWER_S)
    assert not runner.is_alive(), f"an answer still open {HEALED_ANSWER_S:.0f}s after the links healed\n{srv.tail()}"
    assert not got.get("wrong"), "an answer under loss differs from the one before it"
    answers, failure = got["answers"], got["failure"]
    healed = None
    if failure is None:
        try:   # the retransmits may outlast the watchdog just after the window: the group gives up then
            healed = _greedy(srv.url, 0)
        except (httpx.HTTPError, Aborted) as e:
            failure, got["t_fail"] = e, time.monotonic()
    if failure is None:
        assert srv.proc.poll() is None, f"the server exited ({srv.proc.returncode}) with every answer right\n{srv.tail()}"
        assert healed == reference[0], "the first answer on healed links differs"
        rounds = metric(srv.url, "pdrollout:turnstile_rounds_total") - rounds0
        CHAOS_TABLE.append({"fault": f"{loss:.0%} loss on the ranks' links for {LOSS_WINDOW_S:.0f}s",
                            "expected": "carry on",
                            "code": "running", "exit_s": "-", "tree_gone_s": "-",
                            "client": {"generate": (f"{answers} greedy answers equal to the loss-free ones "
                                                    f"({(t_heal - t0) / max(answers, 1):.2f} s each, "
                                                    f"{t_ref:.2f} s without loss); {rounds:.0f} rounds, "
                                                    f"{dropped} packets dropped", "")}})
        assert dropped > 0, f"the rule dropped nothing:\n{stats}"
        assert answers >= 1 and rounds > 0, (answers, rounds)
        srv.proc.send_signal(signal.SIGTERM)   # ... and it still stops cleanly, or
        code = srv.proc.wait(30)
        # ... TCP's backoff held a heartbeat past the bound after the heal, and the group gave up
        # during the stop: its documented code then (once a traceback's 1, CI at abc94e9)
        assert code == 0 or (code in (EXIT_STALL, EXIT_PEER_LOST) and "Traceback" not in srv.tail()), \
            f"exit {code} on SIGTERM after the loss\n{srv.tail()}"
        CHAOS_TABLE[-1]["code"] = f"running, then {code} on SIGTERM"
        assert not wait_gone(tree, 5.0)
        return
    # the group gave up: only with a documented code, within the bound of the first failed answer
    t_fail = got["t_fail"]
    try:
        code = srv.proc.wait(max(0.0, EXIT_WITHIN_S + 10 - (time.monotonic() - t_fail)))
    except subprocess.TimeoutExpired:
        srv.kill()
        pytest.fail(f"{failure!r} {t_fail - t0:.0f}s into the loss, and the server still ran "
                    f"{EXIT_WITHIN_S + 10:.0f}s later\n{srv.tail()}")
    took = time.monotonic() - t_fail
    said = f"{type(failure).__name__}: {str(failure).splitlines()[0][:160]}"
    CHAOS_TABLE.append({"fault": f"{loss:.0%} loss on the ranks' links (first failed answer "
                                 f"{t_fail - t0:.0f}s into it)", "expected": "3 or 4", "code": code,
                        "exit_s": round(took, 1), "tree_gone_s": "-",
                        "client": {"generate": (f"{answers} equal answers, then: {said}", "")}})
    assert code in (EXIT_STALL, EXIT_PEER_LOST), f"exit {code} under loss ({failure!r})\n{srv.tail()}"
    assert took <= EXIT_WITHIN_S, f"exit {took:.1f}s after the first failed answer, bound {EXIT_WITHIN_S}s"
    assert not wait_gone(tree, 5.0)
