"""spec.replicas: a fleet of engine groups by composition (as a Deployment owns ReplicaSets). The parent
PDRollout owns child PDRollouts NAME-0..NAME-(N-1), each one whole group run by the ordinary handlers
(own StatefulSets, rendezvous, restarts); the parent runs no engine pods itself. Pure parts here: the
children's names, bodies and spec hash, the roll plan and the fleet status; fleet_sync.py wires them."""
from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

LABEL_FLEET = "pdrollout.io/fleet"              # on each child and its pods: the router and HPA select it
LABEL_GROUP_INDEX = "pdrollout.io/group-index"  # on each child
SPEC_HASH = "pdrollout.io/fleet-spec-hash"      # child annotation: the parent spec it was last given
FLEET_ONLY = ("replicas", "router", "maxUnavailableGroups")   # the parent's, never a child's
MAX_GROUPS = 100


class GroupSummary(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    name: str
    phase: str | None = None
    ready: bool = False


def child_name(fleet: str, index: int) -> str:
    return f"{fleet}-{index}"


def name_fits(fleet: str, replicas: int, limit: int) -> bool:
    """Whether every child's name (the longest index) fits the limit a rollout's name has."""
    return replicas == 0 or len(child_name(fleet, replicas - 1)) <= limit


def index_of(child: dict) -> int:
    return int(child["metadata"]["labels"][LABEL_GROUP_INDEX])


def child_spec(fleet: str, spec: dict) -> dict:
    """The parent's spec for one group: no fleet fields, and the fleet label on the pods (the builders
    merge podTemplate.template's labels into the pods) so the router and an HPA find every group's pods."""
    out = {k: copy.deepcopy(v) for k, v in spec.items() if k not in FLEET_ONLY}
    tpl = dict(out.get("podTemplate") or {})
    template = dict(tpl.get("template") or {})
    meta = dict(template.get("metadata") or {})
    meta["labels"] = {**(meta.get("labels") or {}), LABEL_FLEET: fleet}
    template["metadata"] = meta
    tpl["template"] = template
    out["podTemplate"] = tpl
    return out


def spec_hash(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def child_body(fleet: str, namespace: str, index: int, spec: dict, api_version: str, kind: str) -> dict:
    want = child_spec(fleet, spec)
    return {"apiVersion": api_version, "kind": kind,
            "metadata": {"name": child_name(fleet, index), "namespace": namespace,
                         "labels": {LABEL_FLEET: fleet, LABEL_GROUP_INDEX: str(index)},
                         "annotations": {SPEC_HASH: spec_hash(want)}},
            "spec": want}


@dataclass(frozen=True)
class Plan:
    create: list[int]     # missing indexes below replicas
    delete: list[int]     # indexes at or above replicas, highest first
    update: list[int]     # children given the new spec now (at most maxUnavailableGroups not ready after)


def plan(have: dict[int, str], ready: dict[int, bool], want_hash: str, replicas: int,
         max_unavailable: int) -> Plan:
    """have: index -> the spec hash each child was given; ready: index -> whether it serves now.
    An outdated child that is already down is updated at once (it costs nothing); a serving one only
    while fewer than max_unavailable groups are down, lowest index first."""
    keep = {i: h for i, h in have.items() if i < replicas}
    down = sum(1 for i in keep if not ready.get(i))
    update = []
    for i in sorted(keep):
        if keep[i] == want_hash:
            continue
        if not ready.get(i):
            update.append(i)
        elif down < max_unavailable:
            update.append(i)
            down += 1
    return Plan(create=[i for i in range(replicas) if i not in have],
                delete=sorted((i for i in have if i >= replicas), reverse=True), update=update)


def summary(fleet: str, children: list[dict], ready: dict[int, bool], replicas: int) -> dict:
    """The parent's status: groups, readyGroups, the scale subresource's replicas/selector, and the
    fleet's makespan and recent TTFT p99 as the worst group's."""
    mine = sorted((c for c in children if index_of(c) < replicas), key=index_of)
    groups = [GroupSummary(name=c["metadata"]["name"], phase=(c.get("status") or {}).get("phase"),
                           ready=bool(ready.get(index_of(c)))) for c in mine]

    def worst(key: str) -> float | None:
        seen = [s[key] for c in mine if (s := c.get("status") or {}).get(key) is not None]
        return max(seen) if seen else None

    return {"replicas": len(mine), "readyGroups": sum(g.ready for g in groups),
            "selector": f"{LABEL_FLEET}={fleet}",
            "groups": [g.model_dump(by_alias=True, exclude_none=True) for g in groups],
            "makespanSeconds": worst("makespanSeconds"), "recentTtftP99Seconds": worst("recentTtftP99Seconds")}
