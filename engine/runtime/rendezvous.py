"""The two turnstile rendezvous over a CPU process group (DESIGN §3, steps 2 and 4).

Every rank calls each rendezvous exactly once per round, with work or without (the matched
no-work call of an idle rank), so the exchange itself can never be left half-matched; what the
ranks said is then compared and any disagreement raises RendezvousMismatchError at once.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..protocol.turnstile import TurnstileError

PRE_D, POST_D = 1, 2
_FIELDS = ("seq", "kind", "epoch", "boundary", "d_ready", "work")


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
class Rendezvous:
    """Wraps a gloo group (None = the default group). world 1 runs without torch.distributed."""

    group: object = None
    world: int | None = None
    seq: int = 0
    latencies: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.world is None:
            import torch.distributed as dist
            self.world = dist.get_world_size(self.group)

    def _exchange(self, kind: int, epoch: int, boundary: int, d_ready: bool, work: bool) -> Agreement:
        row = [self.seq, kind, epoch, boundary, int(bool(d_ready)), int(bool(work))]
        t0 = time.perf_counter()
        if self.world == 1:
            rows = [row]
        else:
            import torch
            import torch.distributed as dist
            mine = torch.tensor(row, dtype=torch.int64)
            out = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(out, mine, group=self.group)
            rows = [o.tolist() for o in out]
        dt = time.perf_counter() - t0
        self.latencies.append(dt)
        self.seq += 1
        keys = {tuple(r[:4]) for r in rows}
        if len(keys) != 1:
            table = "; ".join(f"rank {i}: " + ", ".join(f"{n}={v}" for n, v in zip(_FIELDS, r))
                              for i, r in enumerate(rows))
            raise RendezvousMismatchError(
                f"{'pre-D' if kind == PRE_D else 'post-D'} rendezvous disagrees on (seq, epoch, boundary): {table}")
        return Agreement(seq=row[0], epoch=epoch, boundary=boundary,
                         d_any=any(r[4] for r in rows), ready=[bool(r[4]) for r in rows],
                         work=[bool(r[5]) for r in rows], seconds=dt)

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
