"""Pure parts: topology arithmetic and the turnstile state machine (property-based)."""
import pytest
from hypothesis import given, settings, strategies as st

from pdrollout.engine.protocol.topology import Topology, TopologyError
from pdrollout.engine.protocol.turnstile import END, NO_EPOCH, UNBOUNDED, DuplicateEpochError, MissingProducerError, NonMonotoneBoundaryError, PermitExceededError, PhaseOrderError, ProducerState, SpanError, StaleEpochError, Turnstile, TurnstileError, auto_span, multiplexing


def test_topology_crossed_example():
    t = Topology(4, adp=2, ep=4)
    assert (t.atp, t.etp) == (2, 1)
    assert t.atp_groups == [(0, 1), (2, 3)]
    assert t.dp_groups == [(0, 2), (1, 3)]
    assert t.ep_groups == [(0, 1, 2, 3)]
    assert [t.replica(r) for r in range(4)] == [0, 0, 1, 1]
    assert t.crossed and t.p_collective_group == (0, 1, 2, 3) and t.d_collective_group(3) == (1, 3)


def test_topology_paper_examples_and_axes():
    assert (Topology(8, adp=2, ep=8).atp, Topology(8, adp=2, ep=8).etp) == (4, 1)
    t = Topology(16, adp=8, ep=16)
    assert (t.atp, t.etp) == (2, 1) and t.dp_group(5) == (1, 3, 5, 7, 9, 11, 13, 15)
    assert not Topology(4, adp=4, ep=4).crossed        # ATP1: no model-wide P AllReduce
    assert Topology(4, adp=4, ep=4).p_collective_group is None
    assert not Topology(4, adp=1, ep=4).crossed        # ADP1: no DP gather
    assert Topology(4, adp=1, ep=4).d_collective_group(0) is None
    t = Topology(4, adp=2, ep=2)
    assert t.etp == 2 and t.ep_groups == [(0, 2), (1, 3)] and t.etp_groups == [(0, 1), (2, 3)]


@pytest.mark.parametrize("world,adp,ep,msg", [(4, 3, 4, "ADP 3"), (4, 2, 3, "EP 3"), (0, 1, 1, "world"),
                                              (4, 0, 4, "adp"), (4, 2, True, "ep")])
def test_topology_invalid(world, adp, ep, msg):
    with pytest.raises(TopologyError, match=msg):
        Topology(world, adp, ep)
    with pytest.raises(TopologyError, match="outside"):
        Topology(4, 2, 4).replica(4)


@given(st.sampled_from([1, 2, 4, 8, 16]).flatmap(
    lambda g: st.tuples(st.just(g), st.sampled_from([d for d in (1, 2, 4, 8, 16) if g % d == 0]))))
def test_topology_groups_partition(gd):
    g, d = gd
    t = Topology(g, d, g)
    for groups in (t.atp_groups, t.dp_groups, t.ep_groups):
        assert sorted(r for grp in groups for r in grp) == list(range(g))
    for r in range(g):  # one ATP group and one DP group meet in exactly this rank
        assert set(t.atp_group(r)) & set(t.dp_group(r)) == {r}


# ---- the turnstile: every rejection -------------------------------------------------------

def test_round_basic_and_initial_permit():
    ts = Turnstile(span=2)
    assert ts.begin(0) == 0 and ts.tag() is None
    assert ts.publish(0, 0) is False and ts.tag() == (0, 0)   # p=0: D goes before P enters
    ts.pre_d(0, 0); ts.enqueued()
    assert ts.ack() == 2 and ts.producer is ProducerState.RUNNING
    assert ts.publish(0, 1) is True and ts.publish(0, 2) is False
    ts.pre_d(0, 2); assert ts.ack() == 4                       # no-work round: ACK without D
    ts.finish(0); assert ts.tag() == (0, END)
    ts.pre_d(0, END); ts.ack()
    assert ts.producer is ProducerState.IDLE and ts.tag() == (NO_EPOCH, END)
    assert ts.begin(1, d_enqueued=True) == 2                   # D already enqueued: start at p=K


def test_rejections_each_named():
    ts = Turnstile(span=1)
    with pytest.raises(MissingProducerError, match="no producer"):
        ts.publish(0, 0)
    ts.begin(3)
    with pytest.raises(StaleEpochError):
        ts.publish(2, 0)
    with pytest.raises(MissingProducerError):
        ts.publish(4, 0)
    with pytest.raises(PhaseOrderError):
        ts.begin(5)                     # epoch 3 still active
    with pytest.raises(PermitExceededError, match="past the permitted endpoint 0"):
        ts.publish(3, 1)
    assert ts.publish(3, 0) is False
    ts.pre_d(3, 0)
    ts.ack()
    with pytest.raises(NonMonotoneBoundaryError):
        ts.publish(3, 0)
    with pytest.raises(MissingProducerError):
        ts.pre_d(3, 1)                  # producer running below permit 1: not reached
    with pytest.raises(PhaseOrderError):
        ts.enqueued()
    with pytest.raises(PhaseOrderError):
        ts.ack()
    ts.cancel(3)
    with pytest.raises(DuplicateEpochError):
        ts.begin(3)
    with pytest.raises(StaleEpochError):
        ts.begin(1)
    with pytest.raises(StaleEpochError, match="retired"):
        ts.publish(3, 1)
    with pytest.raises(SpanError):
        ts.set_span(0)
    with pytest.raises(SpanError):
        Turnstile(span=True)
    with pytest.raises(MissingProducerError):
        ts.begin(-1)
    ts.begin(4)
    ts.publish(4, 0)
    ts.pre_d(4, 0)
    with pytest.raises(PhaseOrderError):
        ts.pre_d(4, 0)                  # duplicate pre-D
    with pytest.raises(PhaseOrderError):
        ts.cancel(4)                    # cancel during a round
    ts.ack(span=UNBOUNDED)
    assert ts.permit == UNBOUNDED and ts.publish(4, 10**6)


def test_failed_call_leaves_state_unchanged():
    ts = Turnstile(span=3)
    ts.begin(0)
    before = dict(vars(ts))
    for bad in (lambda: ts.publish(0, 5), lambda: ts.publish(1, 0), lambda: ts.ack(), lambda: ts.finish(7)):
        with pytest.raises(TurnstileError):
            bad()
        assert dict(vars(ts)) == before


def test_activation_and_auto_span():
    assert multiplexing("on", False, True) and not multiplexing("off", True, True)
    assert multiplexing("auto", True, True) and not multiplexing("auto", True, False)
    assert not multiplexing("auto", False, True)
    assert auto_span(1.0, 1.0) == 1 and auto_span(0.0, 1.0) == 4 and auto_span(0.0, 0.0) == 1
    assert all(1 <= auto_span(o / 10, p / 4) <= 4 for o in range(11) for p in range(9))
    assert auto_span(0.2, 1.0) >= auto_span(0.8, 1.0)   # more D rows -> never a longer span


# ---- property-based: random call sequences keep the invariants ---------------------------

OPS = st.lists(st.tuples(st.sampled_from(["begin", "begin_enq", "publish", "skip", "finish", "pre_d",
                                          "enqueued", "ack", "cancel", "span", "stale"]),
                         st.integers(0, 5)), max_size=60)


@settings(max_examples=400, deadline=None)
@given(OPS, st.integers(1, 4))
def test_invariants_under_random_calls(ops, span):
    ts = Turnstile(span=span)
    next_epoch, acks = 0, 0
    published: list[tuple[int, int]] = []
    for op, x in ops:
        before = dict(vars(ts))
        try:
            if op in ("begin", "begin_enq"):
                ts.begin(next_epoch + x % 2, d_enqueued=op == "begin_enq")
                next_epoch = ts.epoch + 1
            elif op == "publish":
                ts.publish(ts.epoch if ts.epoch is not None else next_epoch, ts.reached + 1)
                published.append((ts.epoch, ts.reached))
            elif op == "skip":
                ts.publish(ts.epoch if ts.epoch is not None else 0, ts.reached + 1 + x)
                published.append((ts.epoch, ts.reached))
            elif op == "finish":
                ts.finish(ts.epoch if ts.epoch is not None else 0)
            elif op == "pre_d":
                tag = ts.tag()
                ts.pre_d(*(tag if tag is not None and x % 3 else (x, x)))
            elif op == "enqueued":
                ts.enqueued()
            elif op == "ack":
                p0, was_stopped = ts.permit, ts.producer is ProducerState.AT_PERMIT
                ts.ack()
                acks += 1
                if was_stopped:
                    assert ts.permit == p0 + ts.span     # p <- p + K, exactly
            elif op == "cancel":
                ts.cancel(ts.epoch if ts.epoch is not None else x)
            elif op == "span":
                ts.set_span(x)
            elif op == "stale":
                ts.publish(max(0, (ts.epoch or 0) - 1 - x), 0)
        except TurnstileError:
            assert dict(vars(ts)) == before              # rejections never half-apply
        # invariants
        assert ts.rounds == acks
        if ts.producer is ProducerState.IDLE:
            assert ts.epoch is None and ts.reached == -1
        else:
            assert ts.epoch is not None and ts.reached <= ts.permit
            assert (ts.producer is ProducerState.AT_PERMIT) == (ts.reached == ts.permit)
        if ts.round.value != "none":
            assert ts.producer is not ProducerState.RUNNING  # P never moves inside a round
    for (e1, b1), (e2, b2) in zip(published, published[1:]):
        assert e2 > e1 or b2 > b1                         # monotone within an epoch, epochs increase


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 12), st.booleans())
def test_rounds_per_epoch_follow_span(span, boundaries, d_enqueued):
    """A producer publishing every boundary stops exactly at 0(or K), K, 2K, ... and a round
    releases it each time: rounds = stops + the retiring round."""
    ts = Turnstile(span=span)
    ts.begin(0, d_enqueued=d_enqueued)
    stops = []
    for i in range(boundaries):
        if not ts.publish(0, i):
            stops.append(i)
            ts.pre_d(0, i); ts.enqueued(); ts.ack()
    ts.finish(0); ts.pre_d(0, END); ts.ack()
    first = span if d_enqueued else 0
    assert stops == list(range(first, boundaries, span))
    assert ts.rounds == len(stops) + 1
