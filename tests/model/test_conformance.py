"""The model and turnstile.py/controller.py cannot drift: every reachable transition of the
model's single-rank automaton, every controller decision, and the per-rank event sequences of
multi-rank simulations are replayed through the Python classes."""
from __future__ import annotations

import re
import subprocess
import threading

import pytest

from pdrollout.engine.runtime.controller import TurnstileController
from pdrollout.engine.runtime.rendezvous import Rendezvous
from pdrollout.engine.protocol.turnstile import (
    UNBOUNDED, DuplicateEpochError, MissingProducerError, NonMonotoneBoundaryError, PermitExceededError,
    PhaseOrderError, ProducerState, RoundState, SpanError, StaleEpochError, Turnstile, auto_span)

UNB = 100   # the model's UNBOUNDED
ERRORS = {1: StaleEpochError, 2: DuplicateEpochError, 3: MissingProducerError, 4: NonMonotoneBoundaryError,
          5: PermitExceededError, 6: PhaseOrderError, 7: SpanError}
PRODUCER = list(ProducerState)      # IDLE, RUNNING, AT_PERMIT, FINISHED: the model's 0..3
ROUND = list(RoundState)            # NONE, PRE_D, D_ENQUEUED
EVENTS = ["begin", "publish", "may_pass", "finish", "cancel", "pre_d", "enqueued", "ack", "set_span", "tag"]
ORDERINGS = ["fine-grained", "global-enqueue", "global-complete", "normal", "isolation-only"]
ACTIVATIONS = ["on", "off", "auto"]


def from_model(st) -> Turnstile:
    epoch, last, reached, permit, prod, rnd, span, has_tag, tag_e, tag_b = st
    ts = Turnstile(span=span)
    ts.epoch = None if epoch == -1 else epoch
    ts.last_epoch, ts.reached = last, reached
    ts.permit = UNBOUNDED if permit == UNB else permit
    ts.producer, ts.round = PRODUCER[prod], ROUND[rnd]
    ts.round_tag = (tag_e, tag_b) if has_tag else None
    return ts


def to_model(ts: Turnstile) -> tuple:
    tag = ts.round_tag
    return (-1 if ts.epoch is None else ts.epoch, ts.last_epoch, ts.reached,
            UNB if ts.permit == UNBOUNDED else ts.permit, PRODUCER.index(ts.producer), ROUND.index(ts.round),
            ts.span, int(tag is not None), tag[0] if tag else 0, tag[1] if tag else 0)


def apply(ts: Turnstile, code: int, a: int, b: int):
    """Runs one event; returns (error class or None, the model's `may` column)."""
    name = EVENTS[code]
    try:
        if name == "begin":
            ts.begin(a, d_enqueued=bool(b))
            return None, 0
        if name in ("publish", "may_pass"):
            return None, int(getattr(ts, name)(a, b))
        if name in ("finish", "cancel"):
            getattr(ts, name)(a)
        elif name == "pre_d":
            ts.pre_d(a, b)
        elif name == "enqueued":
            ts.enqueued()
        elif name == "ack":
            ts.ack(span=None if a == 255 else (UNBOUNDED if a == UNB else a))
        elif name == "set_span":
            ts.set_span(a)
        elif name == "tag":
            tag = ts.tag()
            return None, (1, tag) if tag is not None else (0, None)
        return None, 0
    except Exception as e:   # compared by class below
        return type(e), 0


@pytest.fixture(scope="module")
def enumerated(spin):
    return spin.conformance_transitions()


def test_every_reachable_transition_matches_turnstile_py(enumerated):
    rows, stats = enumerated
    assert stats["errors"] == 0 and rows
    mismatches, by_event, errors_seen = [], {}, set()
    for row in rows:
        pre, (code, a, b, err, may), post = row[:10], row[10:15], row[15:]
        ts = from_model(pre)
        rounds = ts.rounds
        got_err, got_may = apply(ts, code, a, b)
        want_err = ERRORS.get(err)
        ok = got_err is want_err and to_model(ts) == tuple(post)
        if EVENTS[code] == "tag":
            has, tag = got_may
            ok = ok and has == may and (not has or tag == (a, b))
        elif got_err is None:
            ok = ok and got_may == may
        if EVENTS[code] == "ack" and want_err is None:
            ok = ok and ts.rounds == rounds + 1
        if not ok:
            mismatches.append((row, got_err, got_may, to_model(ts)))
        by_event[EVENTS[code]] = by_event.get(EVENTS[code], 0) + 1
        errors_seen.add(got_err)
    print(f"\nconformance: {stats['states']} model states, {len(rows)} transitions replayed "
          f"({stats['seconds']:.2f} s in pan): {by_event}")
    assert not mismatches, f"{len(mismatches)} transitions differ, first: {mismatches[:3]}"
    # the enumeration reached every named error, so the comparison covered each check
    assert set(ERRORS.values()) <= errors_seen


def _tagged(ordering, activation, k, e, b, dact, pending):
    ctl = TurnstileController(Rendezvous(world=1), ordering, span=k, activation=activation, p_pending=pending)
    if e == 0:
        ctl.begin(0, d_active=bool(dact))
        if b == -1:
            ctl.finish(0)
        else:   # P stopped at its permit b
            ctl.ts.permit = b
            assert ctl.ts.publish(0, b) is False
    return ctl


def test_controller_decisions_match_the_model(enumerated):
    decisions = enumerated[1]["decisions"]
    # tags (NO_EPOCH, END), (0, END), (0, 0..2) for every ordering, activation, d_active, K
    assert len(decisions) == len(ORDERINGS) * len(ACTIVATIONS) * 2 * 4 * 5
    bad = []
    for o, a, dact, e, b, k, unb, rdv, fence, grant, d_lane in decisions:
        ordering, activation = ORDERINGS[o], ACTIVATIONS[a]
        ctl = TurnstileController(Rendezvous(world=1), ordering, span=k, activation=activation)
        got = {"lane": int(ctl.registered_lane == "d"),
               "begin_unbounded": int(ctl.begin(0, d_active=bool(dact)) == UNBOUNDED)}
        calls = []
        ctl = _tagged(ordering, activation, k, e, b, dact, lambda: calls.append(1) or 0)
        res = ctl.round(True, lambda ready: None)
        got["rendezvous"] = int(res.rendezvous)
        # the fence asks p_pending once more than the ACK's incompleteness check
        got["fence"] = int(len(calls) == 2)
        want = {"lane": d_lane, "begin_unbounded": unb, "rendezvous": rdv, "fence": fence}
        if e == 0 and b >= 0 and ordering != "isolation-only":
            got["grant"] = UNB if res.permit == UNBOUNDED else res.permit - b
            want["grant"] = grant
        if got != want:
            bad.append(((ordering, activation, dact, e, b, k), want, got))
    print(f"\ncontroller decisions compared: {len(decisions)}")
    assert not bad, bad[:5]


def test_auto_span_range_is_the_models():
    """The model lets auto choose any K in 1..4 per round; auto_span's image is exactly that."""
    seen = {auto_span(o / 20, p / 10) for o in range(21) for p in range(-5, 25)}
    assert seen == {1, 2, 3, 4}


EVENT_RE = re.compile(r"@ rank (\d+) (begin|round|ack) (.*)")


def simulate(spin, cfg, seed: int) -> dict[int, list[tuple]]:
    """One random simulation of ranks.pml (`spin -n<seed>`): each rank's begin/round/ack events."""
    import shutil
    import tempfile
    tool, _ = spin.tools()
    work = tempfile.mkdtemp(prefix="pdrollout-spin-sim-")
    try:
        for f in ("ranks.pml", "turnstile.pml", "controller.pml"):
            shutil.copy(spin.HERE / f, work)
        run = subprocess.run([tool, *cfg.defines(), f"-n{seed}", "ranks.pml"], cwd=work, capture_output=True,
                             text=True, timeout=120)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert "assertion violated" not in run.stdout and "invalid end state" not in run.stdout, run.stdout[-3000:]
    events: dict[int, list[tuple]] = {}
    for ln in run.stdout.splitlines():
        m = EVENT_RE.search(ln)
        if m:
            nums = [int(x) for x in re.findall(r"-?\d+", m.group(3))]
            events.setdefault(int(m.group(1)), []).append((m.group(2), *nums))
    return events


def replay(cfg, events: list[tuple]) -> list[str]:
    """Drives a TurnstileController (world-1 rendezvous, a real P thread) through one rank's
    events; returns the differences."""
    ctl = TurnstileController(Rendezvous(world=1), cfg.ordering, span=1 if cfg.span == "auto" else cfg.span,
                              activation=cfg.activation, poll_s=0.005)
    begun = [threading.Event() for _ in range(cfg.epochs)]
    failed: list[BaseException] = []

    def producer():
        try:
            for e in range(cfg.epochs):
                while not begun[e].wait(0.05):
                    if failed:
                        return
                for i in range(cfg.boundaries):
                    ctl.boundary(e, i)
                ctl.finish(e)
        except BaseException as ex:
            failed.append(ex)

    t = threading.Thread(target=producer, daemon=True)
    t.start()
    diffs = []
    ev = iter(events)
    for item in ev:
        if item[0] == "begin":
            _, e, dact, permit = item
            p = ctl.begin(e, d_active=bool(dact))
            begun[e].set()
            if (UNB if p == UNBOUNDED else p) != permit:
                diffs.append(f"begin({e}) -> permit {p}, model {permit}")
            continue
        assert item[0] == "round", item
        _, e, b, ready, rdv = item
        ack = next(ev)
        _, ae, ab, any_, k, permit = ack
        if cfg.span == "auto":
            ctl.set_control(span=k)
        res = ctl.round(bool(ready), lambda r: None)
        got = (res.epoch, res.boundary, int(res.rendezvous), int(res.d_any),
               UNB if res.permit == UNBOUNDED else res.permit)
        if got != (e, b, rdv, any_, permit):
            diffs.append(f"round {got} != model {(e, b, rdv, any_, permit)}")
        if failed:
            diffs.append(f"producer: {failed[0]!r}")
            break
    t.join(5)
    return diffs


SIMS = [dict(ordering="fine-grained", span=1), dict(ordering="fine-grained", span=3),
        dict(ordering="fine-grained", span="auto"), dict(ordering="fine-grained", activation="auto", span="auto"),
        dict(ordering="global-enqueue"), dict(ordering="global-enqueue", activation="auto"),
        dict(ordering="global-complete", dispatch="fifo"), dict(ordering="normal", d_sync=True),
        dict(ordering="fine-grained", activation="off", dispatch="fifo")]


@pytest.mark.parametrize("kw", SIMS, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_simulated_traces_replay_through_the_controller(spin, kw):
    cfg = spin.Config(4, 2, epochs=2, boundaries=5, d_iters=4, **kw)
    n_events = 0
    for seed in range(1, 6):
        events = simulate(spin, cfg, seed)
        assert sorted(events) == [0, 1, 2, 3]
        for rank, evs in events.items():
            n_events += len(evs)
            diffs = replay(cfg, evs)
            assert not diffs, f"seed {seed} rank {rank}: {diffs[:5]}"
    print(f"\n{cfg.label()}: {n_events} rank events from 5 simulations replayed")
