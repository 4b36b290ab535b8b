"""The two turnstile rendezvous over a CPU process group (docs/DISTRIBUTED.md, steps 2 and 4).

Every rank calls each rendezvous exactly once per round, with work or without (the matched
no-work call of an idle rank), so the exchange itself can never be left half-matched; what the
ranks said is then compared and any disagreement raises RendezvousMismatchError at once.

Two transports carry the same payload with the same semantics (`make_rendezvous(kind, ...)`):

* `gather`: an `all_gather` of six int64 per rank. gloo runs it as a ring, so its latency grows
  with the world (n-1 dependent steps).
* `dissemination`: a dissemination barrier (ceil(log2 n) rounds; in round k rank i sends to
  i+2^k and receives from i-2^k) over gloo point-to-point, carrying a merged summary instead of
  every row: the min and max of (seq, kind, epoch, boundary) and per-rank bitmasks of d_ready and
  work. min, max and OR are idempotent, so information that arrives twice does no harm, and after
  the last round every rank holds the same summary of all ranks. Agreement = min == max. On a
  disagreement every rank sees it at once and all of them gather the full rows for the error.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..protocol.turnstile import TurnstileError

PRE_D, POST_D = 1, 2
_FIELDS = ("seq", "kind", "epoch", "boundary", "d_ready", "work")
_KEY = 4        # (seq, kind, epoch, boundary): the fields every rank must agree on


class RendezvousMismatchError(TurnstileError):
    """Ranks disagreed on the round: they would enqueue different things."""


@dataclass
class Agreement:
    seq: int
    epoch: int
    boundary: int
    d_any: bool              # some rank has a D iteration: every rank enqueues one (idle-shaped if not ready)
    ready: list[bool]        # per-rank d_ready as said
    work: list[bool]         # per-rank work flag (False = matched no-work call)
    seconds: float


@dataclass
class Summary:
    """What a transport returns: the key's range over the ranks and every rank's flags."""
    lo: list[int]
    hi: list[int]
    ready: list[bool]
    work: list[bool]
    rows: list[list[int]] | None = None   # every rank's row, where the transport has them


@dataclass
class Rendezvous:
    """The interface: a group (None = the default group) and the world; subclasses supply
    `_transport`. world 1 runs without torch.distributed."""

    group: object = None
    world: int | None = None
    seq: int = 0
    latencies: list[float] = field(default_factory=list)
    kind = "abstract"

    def __post_init__(self) -> None:
        if self.world is None:
            import torch.distributed as dist
            self.world = dist.get_world_size(self.group)

    def _transport(self, row: list[int]) -> Summary:
        raise NotImplementedError

    def _gather_rows(self, row: list[int]) -> list[list[int]]:
        import torch
        import torch.distributed as dist
        mine = torch.tensor(row, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine, group=self.group)
        return [o.tolist() for o in out]

    def _exchange(self, kind: int, epoch: int, boundary: int, d_ready: bool, work: bool) -> Agreement:
        row = [self.seq, kind, epoch, boundary, int(bool(d_ready)), int(bool(work))]
        t0 = time.perf_counter()
        if self.world == 1:
            s = Summary(row[:_KEY], row[:_KEY], [bool(d_ready)], [bool(work)], [row])
        else:
            s = self._transport(row)
        dt = time.perf_counter() - t0
        self.latencies.append(dt)
        self.seq += 1
        if s.lo != s.hi:
            rows = s.rows if s.rows is not None else self._gather_rows(row)  # every rank is here
            table = "; ".join(f"rank {i}: " + ", ".join(f"{n}={v}" for n, v in zip(_FIELDS, r))
                              for i, r in enumerate(rows))
            raise RendezvousMismatchError(
                f"{'pre-D' if kind == PRE_D else 'post-D'} rendezvous disagrees on (seq, epoch, boundary): {table}")
        return Agreement(seq=row[0], epoch=epoch, boundary=boundary, d_any=any(s.ready),
                         ready=s.ready, work=s.work, seconds=dt)

    def pre_d(self, epoch: int, boundary: int, d_ready: bool, work: bool = True) -> Agreement:
        """Rendezvous 1: agree on (epoch, boundary) and whether any rank has a D iteration ready."""
        return self._exchange(PRE_D, epoch, boundary, d_ready, work)

    def post_d(self, epoch: int, boundary: int, enqueued: bool, expect: bool) -> Agreement:
        """Rendezvous 2 (ACK): every rank's D launch returned. Orders enqueue, not completion."""
        a = self._exchange(POST_D, epoch, boundary, enqueued, True)
        if any(r != expect for r in a.ready):
            raise RendezvousMismatchError(
                f"post-D ACK (epoch={epoch}, boundary={boundary}): D enqueued per rank {a.ready}, "
                f"but the pre-D agreement was {expect}")
        return a

    def stats(self) -> dict:
        xs = sorted(self.latencies)
        if not xs:
            return {"count": 0, "mean_s": 0.0, "p50_s": 0.0, "p99_s": 0.0}
        return {"count": len(xs), "mean_s": sum(xs) / len(xs), "p50_s": xs[len(xs) // 2],
                "p99_s": xs[min(len(xs) - 1, int(0.99 * len(xs)))]}


@dataclass
class GatherRendezvous(Rendezvous):
    """Every rank's row to every rank (`all_gather`; a ring in gloo)."""
    kind = "gather"

    def _transport(self, row: list[int]) -> Summary:
        return self._summary(self._gather_rows(row))

    @staticmethod
    def _summary(rows: list[list[int]]) -> Summary:
        keys = [r[:_KEY] for r in rows]
        return Summary([min(c) for c in zip(*keys)], [max(c) for c in zip(*keys)],
                       [bool(r[4]) for r in rows], [bool(r[5]) for r in rows], rows)


@dataclass
class DisseminationRendezvous(Rendezvous):
    """ceil(log2 n) rounds of point-to-point exchanges carrying a merged summary (module doc).

    Every receive of a call is posted in round 0, so gloo's receiver-ready notice is on its way
    before the peer's send (a send waits for it: posting late costs one more network crossing).
    Each round has its own tag and buffers; gloo matches a (peer, tag) pair in posting order, so
    a fast peer's next call cannot be taken for this one."""
    kind = "dissemination"

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.world
        self.rounds = len(distances(n))          # ceil(log2 n)
        if n == 1:
            return
        import torch
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_group
        self._pg = self.group if self.group is not None else _get_default_group()
        me = self.me = dist.get_rank(self.group)
        self._peers = [((me + d) % n, (me - d) % n) for d in distances(n)]
        self._np_state = encode([0] * 6, me, n)
        self._send = [torch.zeros(len(self._np_state), dtype=torch.int64) for _ in range(self.rounds)]
        self._recv = [torch.zeros(len(self._np_state), dtype=torch.int64) for _ in range(self.rounds)]
        # numpy views share the tensors' memory: the merge is three small vector ops per round
        self._np_send = [t.numpy() for t in self._send]
        self._np_recv = [t.numpy() for t in self._recv]

    def _transport(self, row: list[int]) -> Summary:
        st = self._np_state
        encode(row, self.me, self.world, out=st)
        peers = self._peers
        recvs = [self._pg.recv([self._recv[0]], peers[0][1], 0)]
        sends = []
        for k, (dst, _) in enumerate(peers):
            self._np_send[k][:] = st
            sends.append(self._pg.send([self._send[k]], dst, k))
            if k == 0:   # the later rounds' receives, posted while round 0 is in flight
                recvs += [self._pg.recv([self._recv[j]], src, j) for j, (_, src) in enumerate(peers) if j]
            recvs[k].wait()
            merge(st, self._np_recv[k])
        for s in sends:
            s.wait()
        # freed at the next call: dropping gloo point-to-point works right after they complete
        # cost milliseconds per call here (the p50 went from 0.13 to 2-4 ms at two ranks)
        self._works = (recvs, sends)
        return decode(st, self.world)


def distances(n: int) -> list[int]:
    """The dissemination rounds: in round k rank i sends to i+d_k and receives from i-d_k (mod n)."""
    return [1 << k for k in range((n - 1).bit_length())]


def encode(row: list[int], me: int, n: int, out=None):
    """One rank's summary as an int64 numpy vector: the key as min, the key as max, then two
    bitmaps of n bits (d_ready, work; bit r = byte r // 8, bit r % 8 of the bytes)."""
    import numpy as np
    words = -(-n // 64)
    st = np.zeros(2 * _KEY + 2 * words, dtype=np.int64) if out is None else out
    st[:_KEY] = row[:_KEY]
    st[_KEY:2 * _KEY] = row[:_KEY]
    st[2 * _KEY:] = 0
    flags = st[2 * _KEY:].view(np.uint8)
    byte, bit = divmod(me, 8)
    flags[byte] = int(bool(row[4])) << bit
    flags[8 * words + byte] = int(bool(row[5])) << bit
    return st


def merge(st, got) -> None:
    """st <- st merged with a peer's summary (in place; idempotent, commutative)."""
    import numpy as np
    k2 = 2 * _KEY
    np.minimum(st[:_KEY], got[:_KEY], out=st[:_KEY])
    np.maximum(st[_KEY:k2], got[_KEY:k2], out=st[_KEY:k2])
    np.bitwise_or(st[k2:], got[k2:], out=st[k2:])


def decode(st, n: int) -> Summary:
    import numpy as np
    words = -(-n // 64)
    bits = np.unpackbits(st[2 * _KEY:].view(np.uint8), bitorder="little").astype(bool)
    return Summary(st[:_KEY].tolist(), st[_KEY:2 * _KEY].tolist(), bits[:n].tolist(),
                   bits[64 * words:64 * words + n].tolist())


RENDEZVOUS = {c.kind: c for c in (GatherRendezvous, DisseminationRendezvous)}


def make_rendezvous(kind: str = "gather", group=None, world: int | None = None) -> Rendezvous:
    """The configured transport (`RankOptions.rendezvous`, `--rendezvous`)."""
    try:
        cls = RENDEZVOUS[kind]
    except KeyError:
        raise ValueError(f"rendezvous must be one of {'|'.join(RENDEZVOUS)}, got {kind!r}") from None
    return cls(group, world=world)
