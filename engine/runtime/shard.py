"""Which slice of the model a rank holds."""
from __future__ import annotations

from ..model.qwen3_moe import Shard
from ..protocol.topology import Topology


def shard_of(topo: Topology, rank: int) -> Shard:
    # ETP>1 replicates each expert shard over its ETP group (no expert tensor parallelism).
    return Shard(topo.local_index(rank), topo.atp, rank // topo.etp, topo.ep)
