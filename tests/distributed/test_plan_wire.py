"""The per-step control plane: plans and reports in a binary layout (runtime/plan_wire.py) and their
channel over real gloo ranks (runtime/plan_channel.py).

A rank's decoded plan must equal rank 0's work for its replica, row by row, over a run of steps in
which requests arrive, grow, lose and change their block tables, run twice in a step, finish and
come back under the same id; the rank-shared counts must equal every replica's. A rank receives its
replica's rows only, so its bytes do not grow with the replicas."""
from __future__ import annotations

import random

import pytest

from pdrollout.engine.protocol.config import ControlSettings
from pdrollout.engine.protocol.plan import EngineOp, NewRequest, Phase, ReplicaShape, ReplicaWork, RowSpec, StepPlan, \
    StepReport
from pdrollout.engine.runtime.plan_wire import HEAD, PlanDecoder, PlanEncoder, WireError, decode_report, encode_report
from pdrollout.engine.scheduler.request import SamplingParams
from tests.ranks import assert_ok, run_ranks


class Requests:
    """A replica set's requests over steps, as the schedulers move them (rank 0's side)."""

    def __init__(self, adp: int, seed: int, rows: int = 12) -> None:
        self.rng, self.adp, self.rows = random.Random(seed), adp, rows
        self.live: dict[str, dict] = {}
        self.n = 0
        self.control = ControlSettings().model_dump()

    def step(self, step: int) -> StepPlan:
        rng, new, drop = self.rng, [], []
        for rid in [r for r in self.live if rng.random() < 0.08]:
            drop.append(rid)
            del self.live[rid]
        while len(self.live) < self.adp * self.rows and rng.random() < 0.7:
            self.n += 1
            rid = f"req-{self.n}" if rng.random() < 0.9 or not drop else drop.pop()   # a retry under its id
            rep = rng.randrange(self.adp)
            self.live[rid] = {"rep": rep, "blocks": [rng.randrange(10_000) for _ in range(rng.randrange(1, 6))],
                              "pos": rng.randrange(1, 400), "fresh": True}
            new.append(NewRequest(rid, rep, SamplingParams(temperature=rng.choice([0.0, 0.7]), seed=rng.randrange(9),
                                                         stop_token_ids=(1, rng.randrange(500)))))
        works = [([], []) for _ in range(self.adp)]
        for rid, q in self.live.items():
            if rng.random() < 0.15:
                continue   # waiting this step
            b = q["blocks"]
            roll = rng.random()
            if roll < 0.2:
                b.append(rng.randrange(10_000))
            elif roll < 0.25 and len(b) > 1:
                del b[rng.randrange(1, len(b)):]           # a rollback cuts the table
            elif roll < 0.28:
                q["blocks"] = b = [rng.randrange(10_000) for _ in range(len(b))]   # a new reservation
            if q["fresh"] or rng.random() < 0.1:
                n = rng.randrange(1, 40)
                row = RowSpec(rid, Phase.PREFILL, q["pos"], tuple(rng.randrange(512) for _ in range(n)), tuple(b),
                              rng.random() < 0.5, rng.random() < 0.3, rng.random() < 0.1)
                works[q["rep"]][1].append(row)
                q["fresh"] = False
            else:
                d = rng.choice([0, 0, 0, 2])
                row = RowSpec(rid, Phase.DECODE, q["pos"], tuple(rng.randrange(512) for _ in range(1 + d)), tuple(b),
                              True, rng.random() < 0.3, False, d)
                works[q["rep"]][0].append(row)
            q["pos"] += 1
        if step == 0:   # one request twice in a step, as the warm-up's rows
            w = works[0]
            w[0].append(RowSpec("warmup", Phase.DECODE, 0, (0,), (999,), False))
            w[1].append(RowSpec("warmup", Phase.PREFILL, 0, (0,), (999,), False))
        if rng.random() < 0.1:
            self.control = {**self.control, "span": rng.choice([1, 2, "auto"])}
        return StepPlan(step, self.control, tuple(ReplicaWork(tuple(d), tuple(p)) for d, p in works), tuple(new),
                        tuple(drop), rng.random() < 0.5, p_span=rng.random() < 0.3,
                        p_flight=rng.choice([None, step - 1]), p_collect=rng.random() < 0.2)


def _check(plan: StepPlan, got: StepPlan, replica: int) -> None:
    assert got.replicas[replica] == plan.replicas[replica]
    for r, w in enumerate(plan.replicas):
        g = got.replicas[r]
        if r != replica:
            assert isinstance(g, ReplicaShape)
        assert (g.decode_rows, g.prefill_rows, g.decode_tokens, g.prefill_tokens, g.spec, g.routes) == \
            (w.decode_rows, w.prefill_rows, w.decode_tokens, w.prefill_tokens, w.spec, w.routes)
    assert got.new == tuple(n for n in plan.new if n.replica == replica)
    assert set(got.drop) <= set(plan.drop)
    assert (got.step, got.control, got.multiplexing, got.p_span, got.p_flight, got.p_collect) == \
        (plan.step, plan.control, plan.multiplexing, plan.p_span, plan.p_flight, plan.p_collect)
    assert (got.d_any, got.p_any, got.spec_any, got.routes_any, got.prefill_tokens, got.decode_rows) == \
        (plan.d_any, plan.p_any, plan.spec_any, plan.routes_any, plan.prefill_tokens, plan.decode_rows)


@pytest.mark.parametrize("adp", [1, 3])
def test_every_replica_decodes_its_rows_over_a_run(adp):
    reqs, enc = Requests(adp, seed=adp), PlanEncoder(adp)
    decs = [PlanDecoder(r, adp) for r in range(adp)]
    made = changed = 0
    for step in range(300):
        plan = reqs.step(step)
        bodies, kind, flags, _ = enc.encode(plan)
        for r, d in enumerate(decs):
            got = d.decode(kind, flags, plan.step, -1 if plan.p_flight is None else plan.p_flight, bodies[r])
            _check(plan, got, r)
        made += sum(len(t.rows) for t in enc.tables)
        changed += sum(1 for w in plan.replicas for row in w.decode if row.draft)
    assert made and changed   # the run exercised slots and verify rows
    # both sides forgot the dropped requests: the tables hold the live ones (and the warm-up row)
    for r, d in enumerate(decs):
        assert set(d.slot_of) == set(enc.tables[r].rows)
        assert set(enc.tables[r].rows) <= set(reqs.live) | {"warmup"}


def test_a_rank_receives_its_replica_only_and_a_decode_row_costs_bytes_not_its_block_table():
    """64 decode rows a replica, 2k tokens of context each: the body is the same size at ADP2 and ADP8
    but for the counts (13 bytes a replica), and after the first step a row carries its slot, position
    and token, not its 128 blocks."""
    def plan(adp, step):
        return StepPlan(step, {}, tuple(ReplicaWork(tuple(
            RowSpec(f"r{a}-{i}", Phase.DECODE, 2048 + step, (7,), tuple(range(i * 200, i * 200 + 129)), True)
            for i in range(64))) for a in range(adp)))
    sizes = {}
    for adp in (2, 8):
        enc = PlanEncoder(adp)
        first = enc.encode(plan(adp, 0))[0][0]
        steady = enc.encode(plan(adp, 1))[0][0]
        sizes[adp] = len(steady)
        assert len(first) > 64 * 129 * 4 > 4 * len(steady)
    assert sizes[8] - sizes[2] == 6 * 13
    assert HEAD.size + sizes[8] < 2048


def test_a_torn_payload_is_a_named_error():
    enc, dec = PlanEncoder(1), PlanDecoder(0, 1)
    plan = StepPlan(3, {}, (ReplicaWork((RowSpec("a", Phase.DECODE, 5, (1,), (2,), True),)),))
    body = enc.encode(plan)[0][0]
    with pytest.raises(WireError, match="step 3: replica 0's plan does not decode"):
        dec.decode(1, 0, 3, -1, body[:len(body) // 2])


def test_reports_carry_tokens_verify_rows_and_extras():
    import torch
    slots = {"a": 0, "b": 3, "c": 9}
    h = torch.arange(6, dtype=torch.bfloat16).view(2, 3)
    rep = StepReport(2, 11, {"a": (5, None), "b": (7, -0.25), "c": ((3, 4, 5), (-0.5, -1.5, -2.0)), "x": ((1,), None)},
                     ops=[None, "boom"], p_ready=True, p_done=9, graph=True, jit_compiles=("k1",),
                     routes={"a": b"\x00\x01\x02"}, hidden={"b": [(4, h)]})
    back = decode_report(encode_report(rep, slots), {v: k for k, v in slots.items()}.__getitem__)
    assert back.tokens == rep.tokens and back.ops == rep.ops and back.routes == rep.routes
    assert (back.rank, back.step, back.p_ready, back.p_pending, back.p_done, back.graph, back.jit_compiles) == \
        (2, 11, True, False, 9, True, ("k1",))
    assert back.hidden["b"][0][0] == 4 and torch.equal(back.hidden["b"][0][1], h)
    bare = decode_report(encode_report(StepReport(1, 2, {"a": (5, None)}), slots), {0: "a"}.__getitem__)
    assert bare.tokens == {"a": (5, None)} and bare.p_done is None and not bare.ops


def _channel_ranks(ctx, adp, steps):
    """Rank 0 sends a run of plans (a prompt-sized one and an op plan among them: second transfers);
    every rank checks its decoded plan, and reports its tokens (one a routes blob past its size)."""
    from pdrollout.engine.protocol.topology import Topology
    from pdrollout.engine.runtime.plan_channel import PlanChannel
    topo = Topology(ctx.world, adp, ctx.world)
    ch = PlanChannel(topo, ctx.rank)
    reqs = Requests(adp, seed=7, rows=20)
    transfers = []
    for step in range(steps):
        plan = reqs.step(step)
        if step == 5:   # a long prompt: past the scatter's size
            w = plan.replicas[0]
            plan = StepPlan(step, plan.control, (ReplicaWork(w.decode, w.prefill + (
                RowSpec("long", Phase.PREFILL, 0, tuple(range(3000)), (1,), False),)),) + plan.replicas[1:],
                plan.new, plan.drop)
        if step == 8:
            plan = StepPlan(step, plan.control, ops=(EngineOp("release", {"tags": ["kv_cache"]}),))
        if ctx.rank == 0:
            ch.send(plan)
            mine = StepReport(0, step)
            reports = ch.gather(mine)
            transfers.append((ch.last.transfers, ch.last.collected, ch.last.plan_bytes))
            for r, rep in enumerate(reports[1:], 1):
                rows = [x for x in plan.replicas[topo.replica(r)].decode if x.samples] if not plan.ops else []
                assert rep.tokens == {x.rid: (x.tokens[0] + r, None) for x in rows}, (step, r)
                assert rep.ops == ([f"rank {r}"] if plan.ops else [])
                if step == 3 and r == 1:
                    assert rep.routes == {"big": bytes(range(256)) * 40}
        else:
            got = ch.recv()
            if plan.ops:
                assert got.ops == plan.ops
            else:
                _check(plan, got, topo.replica(ctx.rank))
            mine = got.replicas[topo.replica(ctx.rank)] if not got.ops else ReplicaWork()
            rep = StepReport(ctx.rank, step, {x.rid: (x.tokens[0] + ctx.rank, None) for x in mine.decode if x.samples},
                             ops=[f"rank {ctx.rank}"] if got.ops else [])
            if step == 3 and ctx.rank == 1:
                rep.routes = {"big": bytes(range(256)) * 40}
            ch.report(rep)
    if ctx.rank == 0:
        ch.send(StepPlan(steps, {}, stop=True))
    else:
        assert ch.recv().stop
    return transfers


@pytest.mark.parametrize("world,adp", [(2, 2), (4, 2)])
def test_the_channel_over_gloo_ranks(world, adp):
    outs = run_ranks(_channel_ranks, world, (adp, 12), timeout_s=120)
    assert_ok(outs)
    transfers = outs[0].result
    assert [c for _, c, _ in transfers] == [i == 3 for i in range(12)]   # the routes past the report's size
    assert transfers[5][0] >= 3 and transfers[5][2] > 3000 * 4            # the long prompt: a second scatter
    assert transfers[10][0] == 2 and transfers[10][2] < transfers[5][2]      # a steady step: one scatter, one gather


def test_a_block_table_is_one_tuple_until_it_changes():
    """The encoder takes an unchanged table by identity (kv_pool.BlockTable): every way to change it
    must give a new tuple, else a row would keep a stale table on the other ranks."""
    from pdrollout.engine.scheduler.kv_pool import BlockTable
    changes = [lambda b: b.append(9), lambda b: b.extend([9]), lambda b: b.__iadd__([9]), lambda b: b.__delitem__(slice(1, None)),
               lambda b: b.__setitem__(0, 9), lambda b: b.insert(0, 9), lambda b: b.pop(), lambda b: b.remove(2),
               lambda b: b.clear(), lambda b: b.sort(reverse=True), lambda b: b.reverse(), lambda b: b.__imul__(2)]
    for change in changes:
        b = BlockTable([1, 2, 3])
        first = b.frozen()
        assert b.frozen() is first == (1, 2, 3)
        change(b)
        assert b.frozen() is not first and b.frozen() == tuple(b)
    b = BlockTable([1])
    b += [2]                     # the scheduler's own spelling
    assert b.frozen() == (1, 2) and isinstance(b, BlockTable)
