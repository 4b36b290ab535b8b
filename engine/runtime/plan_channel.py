"""The per-step control plane between rank 0 and the other ranks: one scatter of the plan (each rank
its replica's payload, plan_wire.py) and one gather of the reports, over the default gloo group
(docs/DISTRIBUTED.md, "The per-step control plane").

A collective's buffers have one size on every rank, so each plan names the size of the next one
(`next_cap`: half again this step's largest payload, at least MIN_CAP) and of this step's reports (a
bound from its sampling rows). What does not fit goes in a second transfer of the same collective:
a plan's rest in a second scatter its head announces; a report's rest after rank 0 asked for it with
a COLLECT plan, in a gather of the size that plan names. Steady decode steps fit; a step that brings
prompts, ops or routes pays the second transfer.
"""
from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..protocol.plan import StepPlan, StepReport
from .plan_wire import COLLECT, HEAD, MAGIC, OVERFLOW_AT, PlanDecoder, PlanEncoder, WireError, decode_report, \
    encode_report, report_head

MIN_CAP = 1024          # bytes: a plan's scatter is never smaller (the head and a few rows)
FIRST_CAP = 4096        # the first plan's, before any plan named one
MAX_CAP = 1 << 16       # a larger plan goes in two transfers rather than raise every later one
ALIGN = 256


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class Exchange:
    """One step's control plane as this rank saw it (the step log's and the bench's figures)."""
    plan_bytes: int = 0        # received (rank 0: sent to each rank, the largest)
    report_bytes: int = 0      # sent (rank 0: received from each rank, the largest)
    transfers: int = 0         # collectives this step's plan and reports took
    collected: bool = False    # a report did not fit: rank 0 collected its rest
    encode_s: float = 0.0      # CPU (thread time): rank 0 the plan, another rank its report
    decode_s: float = 0.0      # CPU: rank 0 the reports, another rank its plan
    scatter_s: float = 0.0     # wall in the plan's collectives
    gather_s: float = 0.0      # wall in the reports' collectives
    marks: dict = field(default_factory=dict)   # monotonic stamps for the bench's critical path


class PlanChannel:
    def __init__(self, topo, rank: int, group=None) -> None:
        self.topo, self.rank, self.world, self.group = topo, rank, topo.world, group
        self.cap, self.report_cap = FIRST_CAP, 64
        self.last = Exchange()
        self._bufs: dict = {}
        if rank == 0:
            self.enc = PlanEncoder(topo.adp)
        else:
            self.dec = PlanDecoder(topo.replica(rank), topo.adp)
            self._rest = b""   # a report's part past its gather's size, until rank 0 collects it

    def log_fields(self) -> dict:
        """The step log's: this step's plan as this rank got it (rank 0: sent) and its CPU to make it."""
        ex = self.last
        return {"plan_bytes": ex.plan_bytes, "plan_cpu_s": ex.encode_s if self.rank == 0 else ex.decode_s}

    # ---- rank 0 ----------------------------------------------------------------------------
    def send(self, plan: StepPlan) -> None:
        """Every other rank's share of `plan` (rank 0 executes the plan object itself)."""
        ex = self.last = Exchange()
        ex.marks["send"] = time.monotonic()
        c0 = time.thread_time()
        bodies, kind, flags, bound = self.enc.encode(plan)
        sizes = [HEAD.size + len(b) for b in bodies]
        longest = max(sizes)
        next_cap = min(MAX_CAP, max(MIN_CAP, _align(longest + longest // 2)))
        over = _align(longest - self.cap) if longest > self.cap else 0
        self.report_cap = _align(bound)
        p_flight = -1 if plan.p_flight is None else plan.p_flight
        heads = [HEAD.pack(MAGIC, kind, flags, n, over, next_cap, self.report_cap, plan.step, p_flight,
                           self.topo.adp) for n in sizes]
        payloads = [heads[self.topo.replica(r)] + bodies[self.topo.replica(r)] for r in range(self.world)]
        ex.encode_s = time.thread_time() - c0
        ex.plan_bytes = self.cap + over
        self._scatter(payloads, self.cap, over, ex)
        self.cap = next_cap

    def _buffer(self, size: int, rows: int) -> tuple[torch.Tensor, memoryview]:
        """A [rows, size] byte buffer kept per shape (steady steps reuse one), and a flat view of it."""
        key = (rows, size)
        if key not in self._bufs:
            if len(self._bufs) > 8:   # capacities move with the rows: keep the last few shapes
                self._bufs.pop(next(iter(self._bufs)))
            t = torch.empty(rows, size, dtype=torch.uint8)
            self._bufs[key] = (t, memoryview(t.numpy()).cast("B"))
        return self._bufs[key]

    def _scatter(self, payloads: list[bytes], cap: int, over: int, ex: Exchange) -> None:
        t0 = time.monotonic()
        for lo, size in ((0, cap), (cap, over)) if over else ((0, cap),):
            t, flat = self._buffer(size, self.world)
            for r, p in enumerate(payloads):
                part = p[lo:lo + size]
                flat[r * size:r * size + len(part)] = part
            dist.scatter(self._buffer(size, 1)[0][0], list(t), src=0, group=self.group)
            ex.transfers += 1
        ex.scatter_s += time.monotonic() - t0

    def _gather_all(self, size: int) -> bytes:
        t, _ = self._buffer(size, self.world)
        dist.gather(self._buffer(size, 1)[0][0], list(t), dst=0, group=self.group)
        return t.numpy().tobytes()

    def gather(self, mine: StepReport) -> list[StepReport]:
        """Every rank's report (rank 0's own is `mine`), once every rank executed the step."""
        ex = self.last
        size = self.report_cap
        t0 = time.monotonic()
        whole = memoryview(self._gather_all(size))
        ex.transfers += 1
        raws = [whole[r * size:(r + 1) * size] for r in range(self.world)]
        rest = {}
        for r in range(1, self.world):
            n = report_head(raws[r])[2]
            if n:
                rest[r] = n
        if rest:   # the rest of the reports that did not fit: a COLLECT plan, then a second gather
            ex.collected = True
            more = _align(max(n - size for n in rest.values()))
            head = HEAD.pack(MAGIC, COLLECT, 0, HEAD.size, 0, self.cap, more, mine.step, -1, self.topo.adp)
            self._scatter([head] * self.world, self.cap, 0, ex)
            extra = self._gather_all(more)
            ex.transfers += 1
            for r in rest:
                raws[r] = bytes(raws[r]) + extra[r * more:(r + 1) * more]
        ex.gather_s = time.monotonic() - t0
        ex.marks["gathered"] = time.monotonic()
        c0 = time.thread_time()
        tables, replica = self.enc.tables, self.topo.replica
        reports = [mine] + [decode_report(raws[r], tables[replica(r)].rid_of.__getitem__) for r in range(1, self.world)]
        ex.decode_s = time.thread_time() - c0
        ex.report_bytes = size + (max(rest.values()) - size if rest else 0)
        return reports

    # ---- the other ranks -------------------------------------------------------------------
    def recv(self) -> StepPlan:
        """The next plan (answering rank 0's COLLECT plans on the way)."""
        while True:
            ex = self.last = Exchange()
            t0 = time.monotonic()
            buf = self._recv(self.cap)
            magic, kind, flags, n, over, next_cap, report_cap, step, p_flight, adp = HEAD.unpack_from(buf, 0)
            if magic != MAGIC:
                raise WireError(f"rank {self.rank}: a plan with magic {magic:#x}, not {MAGIC:#x}")
            if over:
                buf += self._recv(over)
                ex.transfers += 1
            ex.scatter_s, ex.plan_bytes, ex.transfers = time.monotonic() - t0, self.cap + over, ex.transfers + 1
            ex.marks["received"] = time.monotonic()
            self.cap, self.report_cap = next_cap, report_cap
            if kind != COLLECT:
                break
            rest, self._rest = self._rest, b""
            self._send_report(rest, report_cap)
        c0 = time.thread_time()
        plan = self.dec.decode(kind, flags, step, p_flight, memoryview(buf)[HEAD.size:n])
        ex.decode_s = time.thread_time() - c0
        return plan

    def _recv(self, size: int) -> bytes:
        t = self._buffer(size, 1)[0][0]
        dist.scatter(t, None, src=0, group=self.group)
        return t.numpy().tobytes()

    def report(self, report: StepReport) -> None:
        ex = self.last
        c0 = time.thread_time()
        raw = encode_report(report, self.dec.slot_of)
        size = self.report_cap
        if len(raw) > size:   # the head says how much there is; the rest waits for rank 0's COLLECT
            raw = bytearray(raw)
            struct.pack_into("<I", raw, OVERFLOW_AT, len(raw))
            raw, self._rest = bytes(raw[:size]), bytes(raw[size:])
        ex.encode_s = time.thread_time() - c0
        ex.report_bytes = size
        ex.marks["report"] = time.monotonic()
        t0 = time.monotonic()
        self._send_report(raw, size)
        ex.gather_s = time.monotonic() - t0
        ex.transfers += 1

    def _send_report(self, raw: bytes, size: int) -> None:
        t, flat = self._buffer(size, 1)
        flat[:len(raw)] = raw
        dist.gather(t[0], None, dst=0, group=self.group)
