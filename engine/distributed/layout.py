"""The group layout: which processes form one engine and where this one sits (stdlib only).

One engine spans `nnodes` nodes (pods) of `nproc_per_node` local ranks each (GPUs on CUDA,
processes on CPU); node k starts global ranks k·L … k·L+L-1. Node 0 hosts the rendezvous store
and the HTTP API; the other nodes run worker ranks and serve /health and /metrics.

The layout has one source of truth per deployment, read in this order (later wins):
  1. the layout file (the operator's `rollout.json`, path in PDROLLOUT_ROLLOUT_INFO or --layout),
  2. PDROLLOUT_* environment variables (torchrun-style launches, hand-written pods),
  3. command-line flags.
The operator writes the file (one ConfigMap for every pod) and only the pod-specific node rank
and address as env, so `pdrollout serve` runs with the same arguments in every pod.
The operator imports this module to write that file, so both sides use the same keys.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from .topology import Topology, TopologyError

DEVICES = ("cpu", "cuda")
EXPERT_BACKENDS = ("torch", "deep_ep")
DEFAULT_MASTER_PORT = 29500
DEFAULT_JOIN_TIMEOUT_S = 300.0
LAYOUT_FILE_ENV = "PDROLLOUT_ROLLOUT_INFO"


class LayoutError(ValueError):
    """A layout that cannot form a group (bad value, or sources that contradict each other)."""


@dataclass(frozen=True)
class Field:
    env: str            # PDROLLOUT_* variable
    file_key: str | None   # key in the layout file (None: pod-specific, never in the shared file)
    kind: type


# attribute -> where it can come from (the flags are the attribute names with dashes)
SOURCES: dict[str, Field] = {
    "nnodes": Field("PDROLLOUT_NNODES", "nodes", int),
    "node_rank": Field("PDROLLOUT_NODE_RANK", None, int),
    "nproc_per_node": Field("PDROLLOUT_NPROC_PER_NODE", "gpusPerNode", int),
    "master_addr": Field("PDROLLOUT_MASTER_ADDR", "masterAddr", str),
    "master_port": Field("PDROLLOUT_MASTER_PORT", "masterPort", int),
    "adp": Field("PDROLLOUT_ADP", "attentionDataParallel", int),
    "ep": Field("PDROLLOUT_EP", "expertParallel", int),
    "device": Field("PDROLLOUT_DEVICE", "device", str),
    "expert_backend": Field("PDROLLOUT_EXPERT_BACKEND", "expertBackend", str),
    "join_timeout_s": Field("PDROLLOUT_JOIN_TIMEOUT_S", "joinTimeoutSeconds", float),
}


@dataclass(frozen=True)
class GroupLayout:
    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None       # default: 29500 on several nodes, a free port (0) on one
    adp: int = 1
    ep: int = 1
    device: str = "cpu"
    expert_backend: str = "torch"
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.master_port is None:   # every node must know a group's port; one node may pick any
            object.__setattr__(self, "master_port", DEFAULT_MASTER_PORT if self.nnodes > 1 else 0)
        for name in ("nnodes", "nproc_per_node", "adp", "ep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise LayoutError(f"{name} must be a positive integer, got {v!r}")
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int) \
                or not 0 <= self.node_rank < self.nnodes:
            raise LayoutError(f"node rank {self.node_rank!r} is outside 0..{self.nnodes - 1} ({self.nnodes} nodes)")
        if not 0 <= self.master_port < 65536:
            raise LayoutError(f"master port {self.master_port} is outside 0..65535")
        if self.master_port == 0 and self.nnodes > 1:
            raise LayoutError("a multi-node group needs a fixed master port (0 picks a free one on one node only)")
        if not self.master_addr:
            raise LayoutError("master address is empty")
        if self.device.split(":")[0] not in DEVICES:
            raise LayoutError(f"device must be one of {'|'.join(DEVICES)} (or cuda:N), got {self.device!r}")
        if self.expert_backend not in EXPERT_BACKENDS:
            raise LayoutError(f"expert backend must be one of {'|'.join(EXPERT_BACKENDS)}, got {self.expert_backend!r}")
        if self.join_timeout_s <= 0:
            raise LayoutError(f"join timeout must be > 0 s, got {self.join_timeout_s}")
        try:
            Topology(self.world, self.adp, self.ep)
        except TopologyError as e:
            raise LayoutError(f"{e} (world = {self.nnodes} nodes × {self.nproc_per_node} local ranks)") from None

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def topology(self) -> Topology:
        return Topology(self.world, self.adp, self.ep)

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.nproc_per_node

    @property
    def local_ranks(self) -> range:
        """Global ranks this node starts."""
        return range(self.first_rank, self.first_rank + self.nproc_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.nproc_per_node

    @property
    def is_master(self) -> bool:
        return self.node_rank == 0

    def describe(self) -> str:
        t = self.topology
        return (f"node {self.node_rank}/{self.nnodes} (ranks {self.first_rank}..{self.local_ranks[-1]} of "
                f"{self.world}), ADP{t.adp} x ATP{t.atp}, EP{t.ep}, {self.device}/{self.expert_backend}, "
                f"master {self.master_addr}:{self.master_port}")

    def to_file(self) -> dict[str, Any]:
        """The shared layout file's content (no pod-specific fields)."""
        return {f.file_key: getattr(self, name) for name, f in SOURCES.items() if f.file_key}


def _coerce(name: str, value: Any, origin: str) -> Any:
    kind = SOURCES[name].kind
    if kind is str:
        return str(value)
    try:
        if kind is int and isinstance(value, str):
            return int(value.strip())
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise LayoutError(f"{origin}: {name} must be {'an integer' if kind is int else 'a number'}, "
                          f"got {value!r}") from None


def read_file(path: str) -> dict[str, Any]:
    """The layout file's known keys as attributes; unknown keys (e.g. the operator's worldSize,
    written for humans) are kept out."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as e:
        raise LayoutError(f"layout file {path}: {e.strerror}") from None
    except ValueError as e:
        raise LayoutError(f"layout file {path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise LayoutError(f"layout file {path}: expected a JSON object")
    by_key = {f.file_key: name for name, f in SOURCES.items() if f.file_key}
    return {by_key[k]: _coerce(by_key[k], v, f"layout file {path}") for k, v in raw.items() if k in by_key}


def resolve(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
            file: str | None = None) -> GroupLayout:
    """Layout from the file, then env, then flags (later wins). `flags` holds attribute names; None
    values are "not given". `nproc` (the world size, the single-node flag) sets nproc_per_node on
    one node and is checked against nnodes × nproc_per_node otherwise."""
    env = os.environ if env is None else env
    flags = dict(flags or {})
    nproc = flags.pop("nproc", None)
    path = flags.pop("layout", None) or file or env.get(LAYOUT_FILE_ENV)
    values: dict[str, Any] = read_file(path) if path else {}
    for name, f in SOURCES.items():
        if env.get(f.env, "") != "":
            values[name] = _coerce(name, env[f.env], f"${f.env}")
    for name, v in flags.items():
        if name not in SOURCES:
            raise LayoutError(f"unknown layout field {name!r}")
        if v is not None:
            values[name] = _coerce(name, v, "--" + name.replace("_", "-"))
    if nproc is not None:
        nproc = _coerce("nnodes", nproc, "--nproc")
        if values.get("nnodes", 1) == 1 and "nproc_per_node" not in values:
            values["nproc_per_node"] = nproc
        elif values.get("nnodes", 1) * values.get("nproc_per_node", 1) != nproc:
            raise LayoutError(f"--nproc {nproc} is the world size, but the layout gives "
                              f"{values.get('nnodes', 1)} nodes × {values.get('nproc_per_node', 1)} local ranks")
    if values.get("nnodes", 1) > 1 and "master_addr" not in values:
        raise LayoutError("a multi-node group needs the master address (--master-addr, "
                          "PDROLLOUT_MASTER_ADDR, or masterAddr in the layout file)")
    return GroupLayout(**values)


def layout_fields() -> tuple[str, ...]:
    return tuple(f.name for f in fields(GroupLayout))


def as_dict(layout: GroupLayout) -> dict[str, Any]:
    return asdict(layout)
