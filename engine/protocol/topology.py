"""Rank topology: the one place for ATP/ETP arithmetic and the collective groups (docs/DISTRIBUTED.md).

World g, attention data-parallel width d (ADP), expert-parallel width e (EP):
ATP = g/d ranks form one attention replica, ETP = g/e ranks shard one expert.
Pure and stdlib-only, so the operator and tests can use it without torch.
"""
from __future__ import annotations

from dataclasses import dataclass

Group = tuple[int, ...]


class TopologyError(ValueError):
    """An impossible (world, adp, ep) combination or a rank outside the world."""


@dataclass(frozen=True)
class Topology:
    world: int
    adp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("world", "adp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise TopologyError(f"{name} must be a positive integer, got {v!r}")
        if self.world % self.adp:
            raise TopologyError(
                f"ADP {self.adp} does not divide world {self.world}: ATP = world/ADP must be whole")
        if self.world % self.ep:
            raise TopologyError(
                f"EP {self.ep} does not divide world {self.world}: ETP = world/EP must be whole")

    @property
    def atp(self) -> int:
        return self.world // self.adp

    @property
    def etp(self) -> int:
        return self.world // self.ep

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise TopologyError(f"rank {rank} outside world of {self.world}")

    def replica(self, rank: int) -> int:
        """Attention replica of a rank (r // ATP)."""
        self._check(rank)
        return rank // self.atp

    def local_index(self, rank: int) -> int:
        """Position of a rank inside its attention replica."""
        self._check(rank)
        return rank % self.atp

    @property
    def world_group(self) -> Group:
        return tuple(range(self.world))

    @property
    def atp_groups(self) -> list[Group]:
        """Attention-TP groups: the ranks of one replica (contiguous)."""
        a = self.atp
        return [tuple(range(i * a, (i + 1) * a)) for i in range(self.adp)]

    @property
    def dp_groups(self) -> list[Group]:
        """DP-attention groups: the same local index across replicas (strided by ATP)."""
        return [tuple(range(j, self.world, self.atp)) for j in range(self.atp)]

    @property
    def etp_groups(self) -> list[Group]:
        """Expert-TP groups: ranks that shard the same experts (contiguous)."""
        t = self.etp
        return [tuple(range(i * t, (i + 1) * t)) for i in range(self.ep)]

    @property
    def ep_groups(self) -> list[Group]:
        """Expert-parallel groups: the same ETP index across expert shards (the whole world when ETP1)."""
        return [tuple(range(j, self.world, self.etp)) for j in range(self.etp)]

    def atp_group(self, rank: int) -> Group:
        return self.atp_groups[self.replica(rank)]

    def dp_group(self, rank: int) -> Group:
        return self.dp_groups[self.local_index(rank)]

    def ep_group(self, rank: int) -> Group:
        self._check(rank)
        return self.ep_groups[rank % self.etp]

    # The registered collective pair of docs/DISTRIBUTED.md. Eager P reduces attention over the model-wide
    # group only when attention is tensor-parallel (ATP>1); graph-replayed D gathers across
    # replicas only when there are several (ADP>1). Reducing either axis to 1 removes one side
    # of the pair, which is why such topologies cannot stall (paper, Table 4).
    @property
    def p_collective_group(self) -> Group | None:
        return self.world_group if self.atp > 1 else None

    def d_collective_group(self, rank: int) -> Group | None:
        return self.dp_group(rank) if self.adp > 1 else None

    @property
    def crossed(self) -> bool:
        """True when P's model-wide group intersects several D groups: crossed orders can stall."""
        return self.atp > 1 and self.adp > 1

    def describe(self) -> str:
        return (f"world {self.world}: ADP{self.adp} x ATP{self.atp}, EP{self.ep} x ETP{self.etp}; "
                f"ATP groups {self.atp_groups}, DP groups {self.dp_groups}, EP groups {self.ep_groups}")
