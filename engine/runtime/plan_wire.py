"""The step plan and the step report between rank 0 and the other ranks in a fixed binary layout
(struct and array, no pickle): one payload per attention replica (docs/DISTRIBUTED.md, "The per-step
control plane").

A rank receives what it needs and no more: the step's rank-shared facts (flags, the P epoch in flight,
every replica's row and token counts, which size the collectives all replicas take part in) and its
own replica's rows. A row names its request by a slot of the replica's row table, which rank 0 and the
replica's ranks keep alike: the request id travels once, when its slot is made, and the block table
as what changed since the slot last carried one (blocks appended, or the whole table when it was cut
or replaced). The control travels when it changed, a new request (its sampling) to its replica only,
a drop to the replicas that knew the request. An op plan (between steps, rare) carries its ops
pickled: their arguments are the API's (paths, tensors, groups), not the step's.

A report carries the replica leader's tokens by slot and a rank's P readiness; op results, Triton
compiles, routes and hidden states go in a JSON section with binary blobs.
"""
from __future__ import annotations

import json
import pickle
import struct
import sys
from array import array
from dataclasses import asdict
from itertools import chain, repeat
from operator import attrgetter, is_

from ..protocol.plan import NewRequest, Phase, ReplicaShape, ReplicaWork, RowSpec, StepPlan, StepReport
from ..scheduler.request import SamplingParams

if sys.byteorder != "little":   # array writes native order; every rank of a group shares the host's
    raise ImportError("plan_wire assumes little-endian hosts")

MAGIC = 0x5044
STEP, OPS, STOP, COLLECT = 1, 2, 3, 4
# head: magic, kind, flags, payload bytes, overflow (rank-shared: bytes of the second transfer, 0 =
# none), the next plan's capacity, this step's report capacity, step, P epoch in flight, replicas
HEAD = struct.Struct("<HBBIIIIqqH")
F_MULTIPLEXING, F_P_SPAN, F_P_COLLECT, F_P_FLIGHT, F_EXTRAS = 1, 2, 4, 8, 16
# report head: magic, flags, pad, bytes, overflow (its whole size when it did not fit), step, P epoch
# done, rank
REPORT = struct.Struct("<HBBIIqqH")
OVERFLOW_AT = 8   # the report head's overflow field
R_PENDING, R_READY, R_DONE, R_GRAPH, R_MULTIPLEXED, R_EXTRAS = 1, 2, 4, 8, 16, 32
SCALAR = 0xFFFF   # a report row's token count for a (token, logprob) pair, not a verify row's tuples
_rid, _start, _tokens, _blocks = attrgetter("rid"), attrgetter("start"), attrgetter("tokens"), attrgetter("blocks")
_samples, _logprob, _routes, _draft = attrgetter("samples"), attrgetter("logprob"), attrgetter("routes"), attrgetter("draft")


class WireError(RuntimeError):
    """A payload that does not decode (a torn or foreign message): the group cannot go on."""


def _arr(code: str, values) -> bytes:
    return array(code, values).tobytes()


class _Reader:
    def __init__(self, buf) -> None:
        self.buf, self.off = memoryview(buf), 0

    def take(self, code: str, n: int) -> tuple:
        fmt = f"<{n}{code}"
        out = struct.unpack_from(fmt, self.buf, self.off)
        self.off += struct.calcsize(fmt)
        return out

    def one(self, code: str):
        return self.take(code, 1)[0]

    def raw(self, n: int) -> bytes:
        out = bytes(self.buf[self.off:self.off + n])
        self.off += n
        return out


class _Table:
    """One replica's row table on rank 0: request id -> [slot, the block table it last carried]."""

    def __init__(self) -> None:
        self.rows: dict[str, list] = {}
        self.rid_of: dict[int, str] = {}
        self.free: list[int] = []
        self.announced: set[str] = set()

    def make(self, rid: str) -> list:
        slot = self.free.pop() if self.free else len(self.rid_of)
        e = self.rows[rid] = [slot, ()]
        self.rid_of[slot] = rid
        return e

    def drop(self, rid: str) -> bool:
        self.announced.discard(rid)
        e = self.rows.pop(rid, None)
        if e is None:
            return False
        del self.rid_of[e[0]]
        self.free.append(e[0])
        return True


class PlanEncoder:
    """Rank 0: a step plan into one body per replica (the head is the channel's: plan_channel.py)."""

    def __init__(self, adp: int) -> None:
        self.tables = [_Table() for _ in range(adp)]
        self._control: dict | None = None

    def encode(self, plan: StepPlan) -> tuple[list[bytes], int, int, int]:
        """(body per replica, kind, flags, the bound on a report's size this step)."""
        if plan.stop:
            return [b""] * len(self.tables), STOP, 0, 64
        if plan.ops:
            blob = pickle.dumps(plan.ops)
            return [blob] * len(self.tables), OPS, 0, 4096
        flags = (F_MULTIPLEXING * plan.multiplexing | F_P_SPAN * plan.p_span | F_P_COLLECT * plan.p_collect
                 | F_P_FLIGHT * (plan.p_flight is not None))
        control = None
        if plan.control and plan.control != self._control:
            control = self._control = dict(plan.control)
        extras = [{} for _ in self.tables]
        for n in plan.new:
            self.tables[n.replica].announced.add(n.rid)
            extras[n.replica].setdefault("new", []).append([n.rid, asdict(n.sampling)])
        for rid in plan.drop:
            for r, t in enumerate(self.tables):
                if rid in t.announced or rid in t.rows:
                    extras[r].setdefault("drop", []).append(rid)
        encoded = [self._rows(t, w) for t, w in zip(self.tables, plan.replicas)]
        counts = list(zip(*(c for _, c, _ in encoded)))   # per replica: rows, rows, tokens, tokens, flags
        shape = b"".join((_arr("H", counts[0]), _arr("H", counts[1]), _arr("I", counts[2]), _arr("I", counts[3]),
                          bytes(counts[4])))
        bodies = []
        for t, (rows, _, _), x in zip(self.tables, encoded, extras):
            for rid in x.get("drop", ()):   # after the rows, as the decoder does
                t.drop(rid)
            if control is not None:
                x["control"] = control
            blob = json.dumps(x, separators=(",", ":")).encode() if x else b""
            bodies.append(b"".join((shape, rows, struct.pack("<I", len(blob)), blob)))
        return bodies, STEP, flags, max(64, *(b for _, _, b in encoded))

    def _rows(self, t: _Table, w: ReplicaWork) -> tuple[bytes, tuple, int]:
        """The replica's rows, its rank-shared counts, and the bound on its leader's report (its
        sampling rows' tokens)."""
        rows = w.decode + w.prefill
        n, nd = len(rows), len(w.decode)
        rids = list(map(_rid, rows))
        ents = list(map(t.rows.get, rids))
        made = []   # (row, request id) of the slots made this step
        if None in ents or len(set(rids)) < n:   # new requests, or one request twice (warm-up rows)
            for i, rid in enumerate(rids):
                e = t.rows.get(rid)
                if e is None:
                    e = t.make(rid)
                    made.append((i, rid))
                ents[i] = e
        blocks = list(map(_blocks, rows))
        # the scheduler hands an unchanged table as the same tuple (kv_pool.BlockTable): identity
        # first, the blocks compared only where it is not
        same = list(map(is_, blocks, [e[1] for e in ents]))
        changed = []   # (row, blocks kept, blocks appended)
        if False in same:
            for i, ok in enumerate(same):
                if not ok:
                    new, old = blocks[i], ents[i][1]
                    ents[i][1] = new
                    if new == old:
                        continue
                    keep = len(old) if len(new) > len(old) and new[:len(old)] == old else 0
                    changed.append((i, keep, new[keep:]))
        toks = list(map(_tokens, rows))
        ntok = array("I", map(len, toks))
        drafts = bytes(map(_draft, rows))   # speculative_k is far below 256
        samples, routes = bytes(map(_samples, rows)), bytes(map(_routes, rows))
        names = [rid.encode() for _, rid in made]
        out = b"".join((
            struct.pack("<HHIII", nd, n - nd, len(made), len(changed), sum(len(c[2]) for c in changed)),
            _arr("I", [e[0] for e in ents]), _arr("i", map(_start, rows)), ntok.tobytes(),
            samples, bytes(map(_logprob, rows)), routes, drafts,
            _arr("i", chain.from_iterable(toks)),
            _arr("I", [c[0] for c in changed]), _arr("I", [c[1] for c in changed]),
            _arr("I", [len(c[2]) for c in changed]), _arr("i", chain.from_iterable(c[2] for c in changed)),
            _arr("I", [i for i, _ in made]), _arr("H", map(len, names)), b"".join(names)))
        d_tok = sum(ntok[:nd])
        counts = (nd, n - nd, d_tok, sum(ntok) - d_tok, (drafts[:nd].count(0) < nd) | (routes.count(0) < n) << 1)
        sampled = samples.count(1)   # a leader's report row: slot, count, flag; an emitted token: id, logprob
        return out, counts, REPORT.size + 8 + 7 * sampled + 12 * (sampled + sum(drafts))


class PlanDecoder:
    """A rank other than 0: its replica's body back into a StepPlan (other replicas as shapes)."""

    def __init__(self, replica: int, adp: int) -> None:
        self.replica, self.adp = replica, adp
        self.rows: dict[int, list] = {}     # slot -> [request id, block table]
        self.slot_of: dict[str, int] = {}
        self.control: dict = {}

    def decode(self, kind: int, flags: int, step: int, p_flight: int, body) -> StepPlan:
        if kind == STOP:
            return StepPlan(step, self.control, stop=True)
        if kind == OPS:
            return StepPlan(step, self.control, ops=pickle.loads(body))
        if kind != STEP:
            raise WireError(f"step {step}: a plan of unknown kind {kind}")
        try:
            return self._step(flags, step, p_flight, _Reader(body))
        except (struct.error, KeyError, UnicodeDecodeError, ValueError) as e:
            raise WireError(f"step {step}: replica {self.replica}'s plan does not decode: {e!r}") from e

    def _step(self, flags: int, step: int, p_flight: int, rd: _Reader) -> StepPlan:
        a = self.adp
        dr, pr, dt, pt, bits = rd.take("H", a), rd.take("H", a), rd.take("I", a), rd.take("I", a), rd.raw(a)
        nd, np_ = rd.take("H", 2)
        nmade, nchg, nblk = rd.take("I", 3)
        n = nd + np_
        slots, starts, ntok = rd.take("I", n), rd.take("i", n), rd.take("I", n)
        samples, logprob, routes, drafts = rd.raw(n), rd.raw(n), rd.raw(n), rd.raw(n)
        toks = rd.take("i", sum(ntok))
        crow, ckeep, cnew, cblk = rd.take("I", nchg), rd.take("I", nchg), rd.take("I", nchg), rd.take("i", nblk)
        mrow, mlen = rd.take("I", nmade), rd.take("H", nmade)
        names = rd.raw(sum(mlen))
        xlen = rd.one("I")
        x = json.loads(rd.raw(xlen)) if xlen else {}
        off = 0
        for i, k in zip(mrow, mlen):
            rid = names[off:off + k].decode()
            off += k
            self.rows[slots[i]] = [rid, ()]
            self.slot_of[rid] = slots[i]
        off = 0
        for i, keep, m in zip(crow, ckeep, cnew):
            e = self.rows[slots[i]]
            e[1] = e[1][:keep] + cblk[off:off + m]
            off += m
        ents = list(map(self.rows.__getitem__, slots))
        if len(toks) == n:   # one token a row (decode): no offsets to walk
            tk = [(t,) for t in toks]
        else:
            tk, off = [], 0
            for c in ntok:
                tk.append(toks[off:off + c])
                off += c
        kinds = [Phase.DECODE] * nd + [Phase.PREFILL] * np_
        out = list(map(_row, [e[0] for e in ents], kinds, starts, tk, [e[1] for e in ents], map(bool, samples),
                       map(bool, logprob), map(bool, routes), drafts))
        drop = tuple(x.get("drop", ()))
        for rid in drop:
            s = self.slot_of.pop(rid, None)
            if s is not None:
                del self.rows[s]
        if "control" in x:
            self.control = x["control"]
        new = tuple(NewRequest(rid, self.replica, _sampling(d)) for rid, d in x.get("new", ()))
        reps = tuple(ReplicaWork(tuple(out[:nd]), tuple(out[nd:])) if r == self.replica else
                     ReplicaShape(dr[r], pr[r], dt[r], pt[r], bool(bits[r] & 1), bool(bits[r] & 2)) for r in range(a))
        return StepPlan(step, self.control, reps, new, drop, bool(flags & F_MULTIPLEXING),
                        p_span=bool(flags & F_P_SPAN), p_flight=p_flight if flags & F_P_FLIGHT else None,
                        p_collect=bool(flags & F_P_COLLECT))


_new = object.__new__


def _row(rid, kind, start, tokens, blocks, samples, logprob, routes, draft) -> RowSpec:
    """RowSpec(...) without its frozen __init__ (a third of its cost, per row per step on every rank)."""
    r = _new(RowSpec)
    r.__dict__.update(rid=rid, kind=kind, start=start, tokens=tokens, blocks=blocks, samples=samples,
                      logprob=logprob, routes=routes, draft=draft)
    return r


def _sampling(d: dict) -> SamplingParams:
    return SamplingParams(**{**d, "stop_token_ids": tuple(d.get("stop_token_ids", ()))})


# ---- the report ------------------------------------------------------------------------------
def encode_report(report: StepReport, slot_of: dict) -> bytes:
    """A rank's report for rank 0: its tokens by slot (a request with no slot here by id, in extras)."""
    slots, counts, lp_rows, flat, lps = [], [], bytearray(), [], []
    x: dict = {}
    for rid, (tok, lp) in report.tokens.items():
        s = slot_of.get(rid)
        if s is None:
            x.setdefault("tokens", {})[rid] = [tok, lp]
            continue
        slots.append(s)
        if isinstance(tok, tuple):
            counts.append(len(tok))
            flat.extend(tok)
        else:
            counts.append(SCALAR)
            flat.append(tok)
        lp_rows.append(lp is not None)
        if lp is not None:
            lps.extend(lp if isinstance(lp, tuple) else (lp,))
    blobs: list[bytes] = []
    if report.ops:
        x["ops"] = report.ops
    if report.jit_compiles:
        x["jit"] = list(report.jit_compiles)
    if report.routes:
        x["routes"] = {rid: _blob(blobs, b) for rid, b in report.routes.items()}
    if report.hidden:
        x["hidden"] = {rid: [[start, *_tensor(blobs, h)] for start, h in parts] for rid, parts in report.hidden.items()}
    flags = (R_PENDING * report.p_pending | R_READY * report.p_ready | R_DONE * (report.p_done is not None)
             | R_GRAPH * report.graph | R_MULTIPLEXED * report.multiplexed | R_EXTRAS * bool(x))
    body = b"".join((struct.pack("<I", len(slots)), _arr("I", slots), _arr("H", counts), bytes(lp_rows),
                     _arr("i", flat), _arr("d", lps)))
    if x:
        doc = json.dumps(x, separators=(",", ":")).encode()
        body += b"".join((struct.pack("<II", len(doc), len(blobs)), doc, _arr("Q", map(len, blobs)), *blobs))
    n = REPORT.size + len(body)
    return REPORT.pack(MAGIC, flags, 0, n, 0, report.step, -1 if report.p_done is None else report.p_done,
                       report.rank) + body


def _blob(blobs: list, b: bytes) -> int:
    blobs.append(bytes(b))
    return len(blobs) - 1


def _tensor(blobs: list, t) -> list:
    import torch
    raw = t.detach().to("cpu").contiguous()
    return [_blob(blobs, raw.view(torch.uint8).numpy().tobytes()), str(raw.dtype).removeprefix("torch."), list(raw.shape)]


def _from_blob(b: bytes, dtype: str, shape: list):
    import torch
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).view(getattr(torch, dtype)).view(shape)


def report_head(buf) -> tuple:
    """(flags, bytes, overflow, step, P epoch done, rank) of a report's first bytes."""
    magic, flags, _, n, overflow, step, done, rank = REPORT.unpack_from(buf, 0)
    if magic != MAGIC:
        raise WireError(f"a report with magic {magic:#x}, not {MAGIC:#x}")
    return flags, n, overflow, step, done, rank


def decode_report(buf, rid_of) -> StepReport:
    """`rid_of(slot)`: the request id of a slot of the sender's replica (rank 0's table)."""
    flags, n, _, step, done, rank = report_head(buf)
    rd = _Reader(buf)
    rd.off = REPORT.size
    k = rd.one("I")
    slots, counts, has_lp = rd.take("I", k), rd.take("H", k), rd.raw(k)
    if counts.count(SCALAR) == k and has_lp.count(0) == k:   # one token a row, no logprobs (decode)
        flat = rd.take("i", k)
        tokens = dict(zip(map(rid_of, slots), zip(flat, repeat(None))))
        return _report_rest(rd, flags, rank, step, done, tokens)
    flat = rd.take("i", sum(1 if c == SCALAR else c for c in counts))
    lps = rd.take("d", sum(1 if c == SCALAR else c for c, h in zip(counts, has_lp) if h))
    tokens, ti, li = {}, 0, 0
    for s, c, h in zip(slots, counts, has_lp):
        m = 1 if c == SCALAR else c
        tok, lp = flat[ti:ti + m], lps[li:li + m] if h else None
        ti, li = ti + m, li + (m if h else 0)
        tokens[rid_of(s)] = (tok[0], lp[0] if h else None) if c == SCALAR else (tok, lp)
    return _report_rest(rd, flags, rank, step, done, tokens)


def _report_rest(rd: _Reader, flags: int, rank: int, step: int, done: int, tokens: dict) -> StepReport:
    r = StepReport(rank, step, tokens, p_pending=bool(flags & R_PENDING), p_ready=bool(flags & R_READY),
                   p_done=done if flags & R_DONE else None, graph=bool(flags & R_GRAPH),
                   multiplexed=bool(flags & R_MULTIPLEXED))
    if flags & R_EXTRAS:
        dlen, nb = rd.take("I", 2)
        x = json.loads(rd.raw(dlen))
        sizes = rd.take("Q", nb)
        blobs = [rd.raw(z) for z in sizes]
        for rid, (tok, lp) in x.get("tokens", {}).items():
            r.tokens[rid] = (tuple(tok), None if lp is None else tuple(lp)) if isinstance(tok, list) else (tok, lp)
        r.ops = x.get("ops", [])
        r.jit_compiles = tuple(x.get("jit", ()))
        r.routes = {rid: blobs[i] for rid, i in x.get("routes", {}).items()}
        r.hidden = {rid: [(start, _from_blob(blobs[i], dt, shape)) for start, i, dt, shape in parts]
                    for rid, parts in x.get("hidden", {}).items()}
    return r
