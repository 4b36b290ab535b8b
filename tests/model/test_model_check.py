"""Exhaustive model check of the turnstile (model/spin/ranks.pml) with spin, and the known-bad
variants' counterexamples. The state counts and times print per configuration; the larger
bounds are in docs/DISTRIBUTED.md ("Model check", `python model/spin/spinrun.py table full`)."""
from __future__ import annotations

import pytest

from pdrollout.engine.protocol.topology import Topology

import spinrun

pytestmark = pytest.mark.timeout(900)
ROWS = spinrun.matrix("ci")


@pytest.mark.parametrize("cfg,mode,expect", ROWS, ids=[f"{i:02d}" for i in range(len(ROWS))])
def test_configuration(spin, cfg, mode, expect):
    res = spin.verify(cfg, mode, timeout_s=600)
    got = spin.outcome(res)
    print(f"\n{cfg.label()} [{mode}]: {got}, {res.states} states, {res.transitions} transitions, "
          f"depth {res.depth}, {res.seconds:.1f} s {res.error}")
    assert got == expect, res.output[-3000:]
    if expect == "pass":
        assert res.complete and res.states > 0


def crossed_wait(cfg, slots: dict) -> tuple | None:
    """Two ranks each holding a collective whose group contains the other, which the other
    does not hold: a wait that neither can end (the groups from topology.py)."""
    topo = Topology(cfg.ranks, cfg.adp, cfg.ranks)

    def group(kind: int, rank: int) -> tuple:
        return {1: topo.world_group, 2: topo.atp_group(rank), 3: topo.dp_group(rank)}[kind]

    held = {r: op for r, op in slots.items() if op is not None}
    for a, opa in held.items():
        for b, opb in held.items():
            if a < b and opa != opb and b in group(opa[0], a) and a in group(opb[0], b):
                return a, opa, b, opb
    return None


BAD = [cfg for cfg, expect in spinrun.bad_variants() if expect == "deadlock"]


@pytest.mark.parametrize("cfg", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_counterexample_shows_the_crossed_wait(spin, cfg):
    res = spin.verify(cfg, keep=True)
    try:
        assert res.errors and "invalid end state" in res.error, res.output[-2000:]
        text = spin.trail(res)
    finally:
        spin.cleanup(res)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("@") or "proc" in ln]
    print(f"\n{cfg.label()}: {res.error}; trail of {len(lines)} lines (spin -t):")
    print("\n".join(lines))
    slots = spin.final_slots(text)
    cross = crossed_wait(cfg, slots)
    assert cross is not None, slots
    a, opa, b, opb = cross
    print(f"crossed wait: rank {a} holds {spin.KIND_NAMES[opa[0]]}#{opa[1]} and waits for rank {b}, "
          f"which holds {spin.KIND_NAMES[opb[0]]}#{opb[1]} and waits for rank {a}")
    # one side is P's world collective, the other a D collective: the crossed P/D pair
    assert {opa[0], opb[0]} & {1} and {opa[0], opb[0]} & {2, 3}


B4 = dict(epochs=1, boundaries=2, d_iters=1)


def test_order_check_flags_isolation_only(spin):
    """On a device that runs ops in enqueue order a deadlock needs a crossed enqueue order: with
    the ORDER assertion on, that order itself is the violation found."""
    res = spin.verify(spinrun.Config(4, 2, ordering="isolation-only", dispatch="fifo", **B4))
    assert res.errors and "dpos" in res.error, res.error


def test_no_pre_d_rendezvous_is_caught_at_the_ack(spin):
    """Without rendezvous 1, ranks that disagree on readiness enqueue D in different rounds; the
    ACK's agreement check (RendezvousMismatchError in rendezvous.py) is what catches it."""
    res = spin.verify(spinrun.Config(4, 2, per_rank_ready=True, no_pre_d=True, **B4))
    assert res.errors and "allr" in res.error, res.error


def test_no_ack_lets_d_overtake_a_permit(spin):
    """Without rendezvous 2 a rank's P passes the permit before a peer enqueued the round's D."""
    res = spin.verify(spinrun.Config(4, 2, no_post_d=True, **B4))
    assert res.errors and "rP" in res.error and "<=" in res.error, res.error
