"""Discrete-event simulator of the turnstile's rendezvous at 2 to 256+ ranks (issue 22).

Pure Python + numpy; no torch. It replays the two transports of rendezvous.py message by
message over a model of gloo's TCP point-to-point protocol (as gloo's transport implements it):

* posting a receive sends the peer a receiver-ready notice; a send's data leaves only once the
  sender holds such a notice (otherwise it waits for it), so data arrives at
  max(send posted, receive posted + one crossing) + one crossing;
* a crossing is one message's latency L (sampled per message); posting costs `post` of CPU;
  a woken thread (the receiver's loop thread, then the waiting one) runs late with probability
  `wake_p` (preemption, OS noise), by a sampled delay; a waiter that spins (`spin`, `spin_s`)
  needs no wake-up for data that arrives while it spins (gloo's loop thread still does, unless
  the transport is `polled`: the spinning thread reads its socket itself);
* (seq, tag) channels are FIFO, as gloo's are.

`gather` is gloo's allgather ring (2(n-1) pipelined sends of half a row each, every send after the
one two back completed) on torch's worker thread; `dissemination` is DisseminationRendezvous
(every receive posted at entry, then ceil(log2 n) rounds of send, wait, merge). Each call also
pays its local Python cost (a + b n, timed in-process) and a per-transport constant fitted at two
ranks (thread hand-offs, what the message model leaves out). With `cores` set, CPU work queues
for a pool of that many cores (the validation runs here oversubscribe 2 cores); `None` = a core
per rank (a GPU host).

Ranks live on nodes of `ranks_per_node`; a message between nodes pays `inter_s` more (assumed:
nothing here measures a second host). Turnstile rounds from engine step logs are in rdvrounds.py;
`fit_fixed()` / `fit_wake_p()` fit the per-call constant / late-wake-up probability to a measured
2-rank p50 / p99.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import asdict, dataclass, field

import numpy as np

TRANSPORTS = ("gather", "dissemination")


@dataclass
class Calibration:
    """Per-machine inputs, measured by `e2e/bench_rendezvous.py --calib` (see `from_bench`)."""
    hop_s: list[float]                # one crossing, post -> waiter resumed, samples (2 ranks, receive pre-posted)
    post_s: float                     # wall (= CPU) per posted send/receive (Python + gloo + the write)
    rx_s: float                       # CPU per incoming message (only with a core pool: it delays others)
    local_s: dict = field(default_factory=dict)   # transport -> (a, b): Python cost a + b n per call
    fixed_s: dict = field(default_factory=dict)   # transport -> fitted constant per call
    cxx_post_s: float = 0.0           # a post inside gloo's C++ ring (not measurable from Python; in L)
    wake_p: float = 0.0               # a thread's wake-up is late (preempted, OS noise) with this probability ...
    wake_s: list[float] = field(default_factory=list)   # ... by one of these delays
    spin: str = "none"                # dissemination's waits that spin before they sleep: none | last | all
    spin_s: float = 0.0               # how long: data arriving within it finds the waiter awake
    polled: bool = False              # the spinning thread polls the socket itself (no loop thread to wake)
    source: str = ""

    @classmethod
    def from_pingpong(cls, rtt_s, post_s: float, rx_s: float, local_s: dict, source: str = "",
                      spike: float = 5.0) -> "Calibration":
        """Split ping-pong round trips into crossings and late wake-ups. A round trip over
        `spike` x the median met a late wake-up (its excess over the median is the delay); the
        rest are crossings, hop = (rtt - post) / 2 (three posts and two crossings per round
        trip, see bench_rendezvous._pingpong). A round trip has 4 wake-ups on its path (each
        crossing wakes the receiver's loop thread, then its waiting thread), so
        spike fraction = 1 - (1 - wake_p) ** 4."""
        rtt = np.asarray(rtt_s, dtype=float)
        med = float(np.median(rtt))
        hit = rtt > spike * med
        body = rtt[~hit]
        return cls(hop_s=((body - post_s) / 2).tolist(), post_s=post_s, rx_s=rx_s, local_s=dict(local_s),
                   wake_p=float(1.0 - (1.0 - hit.mean()) ** 0.25), wake_s=(rtt[hit] - med).tolist(), source=source)

    def wire(self) -> np.ndarray:
        """A message's latency L after its post: the crossing samples less the post."""
        return np.maximum(np.asarray(self.hop_s) - self.post_s, 0.0)

    def scaled(self, factor: float, source: str) -> "Calibration":
        c = Calibration(**asdict(self))
        c.hop_s = [h * factor for h in self.hop_s]
        c.source = source
        return c

    def dump(self) -> dict:
        d = asdict(self)
        d["hop_s"] = [round(h, 9) for h in self.hop_s]
        d["wake_s"] = [round(h, 9) for h in self.wake_s]
        return d


@dataclass
class Net:
    ranks_per_node: int = 8
    inter_s: float = 0.0              # extra one-way latency of a message between nodes
    inter_jitter: float = 0.0         # ... times (1 + this * Exp(1)) per message


class _Handle:
    __slots__ = ("done", "waiter", "awake_until")

    def __init__(self) -> None:
        self.done: float | None = None
        self.waiter: int | None = None
        self.awake_until = -1.0       # a spinning waiter needs no wake-up until then


class _Sim:
    """The event loop: rank programs are generators yielding (op, ...) tuples."""

    def __init__(self, n: int, cal: Calibration, net: Net, cores: float | None, rng: np.random.Generator,
                 notices: bool) -> None:
        self.n, self.cal, self.net, self.rng = n, cal, net, rng
        self.now, self.heap, self.seq = 0.0, [], 0
        # a pool of ceil(cores) servers, each slowed so that together they give `cores`
        self.free = [0.0] * math.ceil(cores) if cores else None
        self.slow = math.ceil(cores) / cores if cores else 1.0
        self.wire = cal.wire()
        self._draw = np.empty(0)
        self._i = 0
        self.ready: dict = {}
        self.pend_send: dict = {}
        self.pend_recv: dict = {}
        self.progs: list = [None] * n
        self.late = np.asarray(cal.wake_s) if cal.wake_p > 0 and cal.wake_s else None
        self.notices = notices        # model the send-ready notice's CPU too (only matters with cores)
        self.awake = [-1.0] * n       # polled transports: a rank spins (reads its socket) until then

    # -- time and CPU
    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.heap, (t, self.seq, fn, args))
        self.seq += 1

    def wake(self) -> float:
        """How late a woken thread runs: 0, or with probability wake_p one of the delays."""
        if self.late is None or self.rng.random() >= self.cal.wake_p:
            return 0.0
        return float(self.late[self.rng.integers(len(self.late))])

    def cpu(self, rank: int, dt: float, fn, *args) -> None:
        t = self.now
        if self.free is None:
            self.at(t + dt, fn, *args)
            return
        start = max(t, heapq.heappop(self.free))
        heapq.heappush(self.free, start + dt * self.slow)
        self.at(start + dt * self.slow, fn, *args)

    def latency(self, a: int, b: int) -> float:
        if self._i >= len(self._draw):
            self._draw = self.rng.choice(self.wire, size=65536)
            self._i = 0
        x = float(self._draw[self._i])
        self._i += 1
        rpn = self.net.ranks_per_node
        if self.net.inter_s and a // rpn != b // rpn:
            j = self.net.inter_jitter
            x += self.net.inter_s * (1.0 + (j * self.rng.exponential() if j else 0.0))
        return x

    # -- the protocol
    def handle(self, rank: int, fn, *args, woken: bool = False) -> None:
        """A message's arrival at `rank`: its loop thread wakes (maybe late); with a core pool
        the handler also waits for a free core, which it then holds for rx (CPU that delays
        other work; the crossing's own latency is in L)."""
        if not woken and not (self.cal.polled and self.now <= self.awake[rank]):
            d = self.wake()
            if d > 0:
                self.at(self.now + d, lambda: self.handle(rank, fn, *args, woken=True))
                return
        if self.free is None:
            fn(*args)
            return
        start = max(self.now, heapq.heappop(self.free))
        heapq.heappush(self.free, start + self.cal.rx_s * self.slow)
        if start > self.now:
            self.at(start, fn, *args)
        else:
            fn(*args)

    def post_recv(self, me: int, src: int, tag: int) -> _Handle:
        h = _Handle()
        self.pend_recv.setdefault((src, me, tag), deque()).append(h)
        self.at(self.now + self.latency(me, src), self.handle, src, self._notice, src, me, tag)
        return h

    def _notice(self, src: int, dst: int, tag: int) -> None:
        q = self.pend_send.get((src, dst, tag))
        if q:
            self._data(q.popleft(), src, dst, tag)
        else:
            self.ready[(src, dst, tag)] = self.ready.get((src, dst, tag), 0) + 1

    def post_send(self, me: int, dst: int, tag: int) -> _Handle:
        h = _Handle()
        key = (me, dst, tag)
        if self.notices and self.free is not None:   # the send-ready notice costs the peer CPU
            self.at(self.now + self.latency(me, dst), self.handle, dst, _noop)
        if self.ready.get(key, 0) > 0:
            self.ready[key] -= 1
            self._data(h, me, dst, tag)
        else:
            self.pend_send.setdefault(key, deque()).append(h)
        return h

    def _data(self, h: _Handle, src: int, dst: int, tag: int) -> None:
        self._complete(h)
        self.at(self.now + self.latency(src, dst), self.handle, dst, self._arrive, src, dst, tag)

    def _arrive(self, src: int, dst: int, tag: int) -> None:
        self._complete(self.pend_recv[(src, dst, tag)].popleft())

    def _complete(self, h: _Handle) -> None:
        h.done = self.now
        if h.waiter is not None:      # the waiting thread wakes (maybe late), unless it still spins
            w, h.waiter = h.waiter, None
            self.at(self.now + (0.0 if self.now <= h.awake_until else self.wake()), self.step, w, None)

    # -- rank programs
    def step(self, rank: int, value) -> None:
        g = self.progs[rank]
        while True:
            try:
                op = g.send(value)
            except StopIteration:
                return
            kind = op[0]
            if kind == "cpu":
                self.cpu(rank, op[1], self.step, rank, None)
                return
            if kind == "delay":
                self.at(self.now + op[1], self.step, rank, None)
                return
            if kind == "recv":
                value = self.post_recv(rank, op[1], op[2])
            elif kind == "send":
                value = self.post_send(rank, op[1], op[2])
            elif kind == "wait":
                h = op[1]
                if h.done is not None:
                    value = None
                    continue
                h.waiter = rank
                if len(op) > 2 and op[2] > 0:
                    h.awake_until = self.awake[rank] = self.now + op[2]
                return
            elif kind == "now":
                value = self.now
            else:
                raise ValueError(op)

    def run(self) -> None:
        for r in range(self.n):
            self.at(0.0, self.step, r, None)
        heap = self.heap
        while heap:
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            fn(*args)


def _noop() -> None:
    return None


def _local(cal: Calibration, kind: str, n: int) -> float:
    a, b = cal.local_s.get(kind, (0.0, 0.0))
    return a + b * n


def _gather(me: int, n: int, cal: Calibration):
    """gloo's allgather ring on torch's worker thread (the caller waits)."""
    nxt, prv = (me + 1) % n, (me - 1) % n
    sends, recvs = [], []
    for i in range(2 * (n - 1)):
        if i >= 2:
            yield ("wait", sends[i - 2])
            yield ("wait", recvs[i - 2])
        if cal.cxx_post_s:
            yield ("cpu", cal.cxx_post_s)
        sends.append((yield ("send", nxt, 0)))
        if cal.cxx_post_s:
            yield ("cpu", cal.cxx_post_s)
        recvs.append((yield ("recv", prv, 0)))
    for h in sends[-2:] + recvs[-2:]:
        yield ("wait", h)


def _dissemination(me: int, n: int, cal: Calibration):
    """DisseminationRendezvous._transport: receive 0, send 0, the other receives, then rounds."""
    ds = [1 << k for k in range((n - 1).bit_length())]
    yield ("cpu", cal.post_s)
    recvs = [(yield ("recv", (me - ds[0]) % n, 0))]
    sends = []
    for k, d in enumerate(ds):
        yield ("cpu", cal.post_s)
        sends.append((yield ("send", (me + d) % n, k)))
        if k == 0:
            for j in range(1, len(ds)):
                yield ("cpu", cal.post_s)
                recvs.append((yield ("recv", (me - ds[j]) % n, j)))
        spin = cal.spin == "all" or (cal.spin == "last" and k == len(ds) - 1)
        yield ("wait", recvs[k], cal.spin_s if spin else 0.0)
    for h in sends:
        yield ("wait", h)


_PROGRAMS = {"gather": _gather, "dissemination": _dissemination}


def _call(kind: str, me: int, n: int, cal: Calibration):
    """One rendezvous call on one rank: local cost, the messages, the fitted constant."""
    loc = _local(cal, kind, n)
    yield ("cpu", loc / 2)
    yield from _PROGRAMS[kind](me, n, cal)
    yield ("cpu", loc / 2)
    fixed = cal.fixed_s.get(kind, 0.0)
    if fixed > 0:
        yield ("delay", fixed)


@dataclass
class Result:
    """Per call and rank: entry, exit (s); latency = exit - entry, as the rank records it."""
    entry: np.ndarray
    exit: np.ndarray

    @property
    def latency(self) -> np.ndarray:
        return self.exit - self.entry

    def transport(self) -> np.ndarray:
        """What the rendezvous adds beyond waiting for the last rank to arrive."""
        return self.exit - self.entry.max(axis=1, keepdims=True)


def simulate(kind: str, n: int, cal: Calibration, calls: int, net: Net | None = None,
             cores: float | None = None, seed: int = 0, gaps=None) -> Result:
    """`calls` rendezvous in a row on every rank. `gaps(call, rng) -> array[n]` (optional) is the
    time each rank spends before entering the call (after leaving the previous one)."""
    rng = np.random.default_rng(seed)
    sim = _Sim(n, cal, net or Net(), cores, rng, notices=True)
    entry = np.zeros((calls, n))
    exit_ = np.zeros((calls, n))
    plan = [gaps(c, rng) if gaps else None for c in range(calls)]

    def prog(me: int):
        for c in range(calls):
            if plan[c] is not None and plan[c][me] > 0:
                yield ("delay", float(plan[c][me]))
            entry[c, me] = yield ("now",)
            yield from _call(kind, me, n, cal)
            exit_[c, me] = yield ("now",)

    sim.progs = [prog(r) for r in range(n)]
    sim.run()
    return Result(entry, exit_)


def quantiles(x: np.ndarray) -> dict:
    x = np.asarray(x).ravel()
    return {"p50_s": float(np.percentile(x, 50)), "p99_s": float(np.percentile(x, 99)),
            "mean_s": float(x.mean()), "n": int(x.size)}


def fit_fixed(kind: str, cal: Calibration, measured_p50_s: float, calls: int = 400,
              cores: float | None = None, seed: int = 0) -> float:
    """The per-call constant that makes the 2-rank p50 equal the measured one (>= 0)."""
    c = Calibration(**asdict(cal))
    c.fixed_s = {**c.fixed_s, kind: 0.0}
    base = np.percentile(simulate(kind, 2, c, calls, cores=cores, seed=seed).latency, 50)
    return max(0.0, float(measured_p50_s - base))


def fit_wake_p(kind: str, cal: Calibration, measured_p99_s: float, calls: int = 3000,
               seeds: tuple = (1, 2, 3), lo: float = 1e-5, hi: float = 0.1) -> float:
    """The late-wake-up probability (delays drawn from cal.wake_s) that makes the simulated
    2-rank p99 equal the measured one: the measured tail read as thread noise, which a
    barrier over n ranks compounds. Bisection in log space; `lo` / `hi` when out of range."""
    if not cal.wake_s:
        raise ValueError("fit_wake_p needs late wake-up delays (cal.wake_s)")

    def p99(p: float) -> float:
        c = Calibration(**{**asdict(cal), "wake_p": p})
        return float(np.median([np.percentile(simulate(kind, 2, c, calls, seed=s).latency[4:], 99)
                                for s in seeds]))

    if p99(lo) >= measured_p99_s:
        return lo
    if p99(hi) <= measured_p99_s:
        return hi
    for _ in range(16):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if p99(mid) < measured_p99_s else (lo, mid)
    return math.sqrt(lo * hi)
