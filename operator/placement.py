"""Where a group's pods go: apart from each other (one pod per node: each is a node rank) and, with
spec.placement.topologyKey, together in one topology domain (a rack or spine), so the group's
all-to-alls stay under one switch.

No rule keeps other rollouts' pods off a node: a CUDA pod requests its GPUs, so a pod that asks for all
of a node's GPUs has the node's GPUs alone, and pods that ask for fewer may share a node with others
(the scheduler's GPU accounting decides, as for any pod)."""
from __future__ import annotations

from pdrollout.operator.models import PDRolloutSpec

HOSTNAME = "kubernetes.io/hostname"


def _group(label: str, name: str) -> dict:
    return {"matchExpressions": [{"key": label, "operator": "In", "values": [name]}]}


def affinity(label: str, name: str, spec: PDRolloutSpec) -> dict:
    """The pod template's affinity: the group's pods on distinct nodes, and in one domain of
    placement.topologyKey when set (Kubernetes lets the first pod match its own affinity term)."""
    out: dict = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": _group(label, name), "topologyKey": HOSTNAME}]}}
    key = spec.placement.topology_key
    if key:
        out["podAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": _group(label, name), "topologyKey": key}]}
    return out
