"""Both rendezvous transports in real rank processes over gloo: the same agreement, the same
errors; and the dissemination summary's merge algebra at sizes we cannot spawn here."""
import random

import numpy as np
import pytest

from ranks import assert_ok, run_ranks
from pdrollout.engine.runtime.rendezvous import (POST_D, PRE_D, RENDEZVOUS, RendezvousMismatchError, decode, distances, encode,
                                                     make_rendezvous, merge)

pytestmark = pytest.mark.timeout(300)
KINDS = sorted(RENDEZVOUS)
ROUNDS = 60


def _pattern(i: int, world: int) -> tuple[list[bool], list[bool]]:
    rng = random.Random(i)
    ready = [rng.random() < 0.3 for _ in range(world)]
    if i % 7 == 0:
        ready = [False] * world            # nobody ready: d_any must be False
    return ready, [rng.random() < 0.7 for _ in range(world)]


def _agree(ctx, kinds):
    import torch.distributed as dist
    rank, world = ctx.rank, ctx.world
    rdvs = {k: make_rendezvous(k, dist.new_group(list(range(world))), world) for k in kinds}
    out = {}
    for kind, rdv in rdvs.items():
        seen, errors = [], []
        for i in range(ROUNDS):
            ready, work = _pattern(i, world)
            a = rdv.pre_d(3, i, ready[rank], work[rank])
            seen.append((a.d_any, a.ready, a.work, a.epoch, a.boundary))
            rdv.post_d(3, i, enqueued=a.d_any, expect=a.d_any)
        # a boundary disagreement: every rank must raise, with every rank's row in the message
        try:
            rdv.pre_d(3, ROUNDS + (rank == world - 1), True)
        except RendezvousMismatchError as e:
            errors.append(str(e))
        # a kind disagreement (one rank in its ACK while the others are in rendezvous 1)
        try:
            if rank == 0:
                rdv.post_d(3, ROUNDS, enqueued=True, expect=True)
            else:
                rdv.pre_d(3, ROUNDS, True)
        except RendezvousMismatchError as e:
            errors.append(str(e))
        # the ACK says D was enqueued on one rank only although the agreement said none
        try:
            rdv.pre_d(3, ROUNDS + 1, False)
            rdv.post_d(3, ROUNDS + 1, enqueued=rank == 0, expect=False)
        except RendezvousMismatchError as e:
            errors.append(str(e))
        # ...and the exchange is still matched afterwards
        a = rdv.pre_d(3, ROUNDS + 2, rank == 1)
        after = (a.d_any, a.ready)
        out[kind] = {"seen": seen, "errors": errors, "after": after, "n_lat": len(rdv.latencies),
                     "lat_ok": all(x > 0 for x in rdv.latencies), "seq": rdv.seq}
    return out


@pytest.fixture(scope="module", params=[2, 5, 8], ids=lambda w: f"world{w}")
def agreed(request):
    world = request.param
    outs = run_ranks(_agree, world, (KINDS,), timeout_s=240)
    assert_ok(outs)
    return world, {o.rank: o.result for o in outs}


@pytest.mark.parametrize("kind", KINDS)
def test_agreement_d_any_and_per_rank_flags(agreed, kind):
    world, res = agreed
    for rank, r in res.items():
        got = r[kind]
        assert len(got["seen"]) == ROUNDS
        for i, (d_any, ready, work, epoch, boundary) in enumerate(got["seen"]):
            want_ready, want_work = _pattern(i, world)
            assert ready == want_ready and work == want_work, (rank, i)
            assert d_any == any(want_ready) and (epoch, boundary) == (3, i)
        # every call recorded a latency, including the ones that raised
        assert got["n_lat"] == got["seq"] == 2 * ROUNDS + 5 and got["lat_ok"]
        assert got["after"] == (world > 1, [k == 1 for k in range(world)])


@pytest.mark.parametrize("kind", KINDS)
def test_disagreement_raises_on_every_rank_with_every_row(agreed, kind):
    world, res = agreed
    for rank, r in res.items():
        boundary, kinds, ack = r[kind]["errors"]
        assert "pre-D rendezvous disagrees" in boundary
        for k in range(world):
            assert f"rank {k}: seq={2 * ROUNDS}, kind={PRE_D}, epoch=3, boundary={ROUNDS + (k == world - 1)}" in boundary
        assert f"rank 0: seq={2 * ROUNDS + 1}, kind={POST_D}" in kinds and f"rank 1: seq={2 * ROUNDS + 1}, kind={PRE_D}" in kinds
        assert "post-D ACK" in ack and str([k == 0 for k in range(world)]) in ack


def test_transports_agree_with_each_other(agreed):
    _, res = agreed
    for r in res.values():
        assert r["gather"]["seen"] == r["dissemination"]["seen"]


def test_world_one_needs_no_process_group():
    for kind in KINDS:
        rdv = make_rendezvous(kind, None, world=1)
        a = rdv.pre_d(0, 0, True)
        assert a.d_any and a.ready == [True] and len(rdv.latencies) == 1
        with pytest.raises(RendezvousMismatchError):
            rdv.post_d(0, 0, enqueued=False, expect=True)
    with pytest.raises(ValueError, match="gather|dissemination"):
        make_rendezvous("tree", None, world=1)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 63, 64, 65, 100, 127, 129, 256, 300])
def test_dissemination_summary_reaches_every_rank_in_ceil_log2_rounds(n):
    """The schedule and merge of DisseminationRendezvous, run for n ranks in one process: after
    ceil(log2 n) rounds every rank's summary equals the truth over all rows; one round fewer
    leaves some rank without some other rank's flags (so the rounds are needed)."""
    rng = np.random.default_rng(n)
    rows = [[7, PRE_D, 2, 5, int(rng.random() < 0.5), int(rng.random() < 0.5)] for _ in range(n)]
    if n > 2:
        rows[n // 2][3] = 6                                      # one rank disagrees on the boundary
    ds = distances(n)
    assert len(ds) == (0 if n == 1 else int(np.ceil(np.log2(n))))

    def run(rounds):
        st = [encode(r, i, n) for i, r in enumerate(rows)]
        for d in ds[:rounds]:
            sent = [s.copy() for s in st]                        # what each rank sends this round
            for i in range(n):
                merge(st[i], sent[(i - d) % n])
        return [decode(s, n) for s in st]

    truth_ready, truth_work = [bool(r[4]) for r in rows], [bool(r[5]) for r in rows]
    for s in run(len(ds)):
        assert s.ready == truth_ready and s.work == truth_work
        assert s.lo == [min(c) for c in zip(*(r[:4] for r in rows))]
        assert s.hi == [max(c) for c in zip(*(r[:4] for r in rows))]
        assert (s.lo != s.hi) == (n > 2)
    if ds:
        rows = [[r[0], r[1], r[2], r[3], 1, 1] for r in rows]    # every flag set: a missing rank shows
        assert any(not all(s.ready) for s in run(len(ds) - 1))

