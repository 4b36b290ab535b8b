"""spec.replicas wired to the API: each reconcile and observer tick of a fleet PDRollout applies its client
Service (and router), creates missing groups, deletes surplus ones highest index first (their pods'
preStop drains them), gives changed specs to at most maxUnavailableGroups serving groups at a time,
and writes the fleet's status. The groups themselves are ordinary PDRollouts (handlers.py)."""
from __future__ import annotations

import json
import threading

import kopf

from pdrollout.operator import builders, fleet, kube, router
from pdrollout.operator.models import GROUP, KIND, PLURAL, VERSION, ConditionType, PDRolloutSpec, Phase

INVALID_SPEC = ConditionType.INVALID_SPEC.value
_DOWN = {Phase.FAILED.value, Phase.RESTARTING.value, Phase.UPDATING.value}


# The change handler and the observer's tick act on one fleet from two threads. A tick reads the spec
# when it starts: after a change handler deleted the groups (spec.replicas unset), a tick begun on the
# old spec created group 0 again, and nothing deleted it. One lock a fleet, and each act checks under
# it that its spec is still the fleet's newest (generation) before it touches a group.
_LOCKS: dict[str, threading.Lock] = {}


def _current(namespace: str, name: str, meta) -> bool:
    live = kube.get_custom(GROUP, VERSION, PLURAL, namespace, name)
    return live is not None and live["metadata"].get("generation") == meta.get("generation")


def _children(name: str, namespace: str, uid: str) -> list[dict]:
    items = kube.list_custom(GROUP, VERSION, PLURAL, namespace, f"{fleet.LABEL_FLEET}={name}")
    return [c for c in items if any(r.get("uid") == uid for r in c["metadata"].get("ownerReferences") or [])]


def _ready(child: dict) -> bool:
    """Serving: the group's controller saw its spec, and every pod is on that spec's template and Ready
    (the readiness probe is the engine's /health: what the router admits too)."""
    meta, status = child["metadata"], child.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("observedGeneration") != meta.get("generation") \
            or status.get("updatingTo") or status.get("phase") in _DOWN:
        return False
    spec = PDRolloutSpec.model_validate(child["spec"])
    want = builders.template_hash(meta["name"], meta["namespace"], spec)
    pods = [p for p in kube.list_pods(meta["namespace"], f"{builders.LABEL_ROLLOUT}={meta['name']}")
            if not p["metadata"].get("deletionTimestamp")]
    return len(pods) == spec.topology.nodes and all(
        (p["metadata"].get("annotations") or {}).get(builders.TEMPLATE_HASH) == want
        and any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in (p.get("status") or {}).get("conditions") or []) for p in pods)


def front(name: str, namespace: str, s: PDRolloutSpec, body, uid: str, logger) -> None:
    """The client Service over every group's node 0, or the router discovering them."""
    workers = {fleet.LABEL_FLEET: name, builders.POD_INDEX_LABEL: "0"}
    svc = builders.api_service(name, namespace, s)
    if not s.router:
        svc["spec"]["selector"] = workers
    objs = [svc, *(router.objects(name, namespace, s.router, s.port, workers) if s.router else [])]
    kopf.adopt(objs, owner=body)
    for obj in objs:
        kube.apply(obj)
    if not s.router:
        for obj in router.stale(name, namespace):
            if not kube.foreign(obj, uid) and kube.delete(obj):
                logger.info(f"deleted {obj['kind']} {obj['metadata']['name']}: spec.router is unset")
    # a rollout that was one group before: its StatefulSet is scaled to 0 (the groups are the children
    # now); deleting it is the garbage collector's job, with the rollout (the chart grants no delete)
    own = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": name, "namespace": namespace}}
    if not kube.foreign(own, uid) and kube.scale_to_zero(own):
        logger.debug(f"StatefulSet {name} at 0: spec.replicas makes the groups child PDRollouts")


def leave(name: str, namespace: str, uid: str, logger) -> None:
    """spec.replicas unset: this rollout is one group again; its former groups go."""
    with _LOCKS.setdefault(uid, threading.Lock()):
        _leave(name, namespace, uid, logger)


def _leave(name: str, namespace: str, uid: str, logger) -> None:
    for child in _children(name, namespace, uid):
        kube.delete_custom(GROUP, VERSION, PLURAL, namespace, child["metadata"]["name"], child["metadata"]["uid"])
        logger.info(f"deleted group {child['metadata']['name']}: spec.replicas is unset")


def sync(name: str, namespace: str, spec: dict, s: PDRolloutSpec, body, meta, status: dict, patch,
         logger) -> None:
    with _LOCKS.setdefault(meta["uid"], threading.Lock()):
        if not _current(namespace, name, meta):
            logger.debug(f"spec generation {meta.get('generation')} is not the newest: its groups are left alone")
            return
        _sync(name, namespace, spec, s, body, meta, status, patch, logger)


def _sync(name: str, namespace: str, spec: dict, s: PDRolloutSpec, body, meta, status: dict, patch,
          logger) -> None:
    limit = builders.max_name_length()
    if not fleet.name_fits(name, s.replicas, limit):
        message = (f"spec.replicas: {s.replicas} groups are named '{fleet.child_name(name, s.replicas - 1)}' "
                   f"at the longest, over the {limit} characters a rollout's name may have; shorten "
                   f"metadata.name or lower spec.replicas")
        patch.status["conditions"] = [c for c in status.get("conditions") or [] if c.get("type") != INVALID_SPEC] \
            + [{"type": INVALID_SPEC, "status": "True", "reason": "FleetNameTooLong", "message": message}]
        patch.status["phase"] = Phase.FAILED.value
        patch.status["observedGeneration"] = meta.get("generation")
        logger.error(message)
        return
    front(name, namespace, s, body, meta["uid"], logger)
    spec = json.loads(json.dumps(dict(spec)))
    want = fleet.child_spec(name, spec)
    want_hash = fleet.spec_hash(want)
    children = {fleet.index_of(c): c for c in _children(name, namespace, meta["uid"])
                if not c["metadata"].get("deletionTimestamp")}
    ready = {i: _ready(c) for i, c in children.items()}
    have = {i: (c["metadata"].get("annotations") or {}).get(fleet.SPEC_HASH) for i, c in children.items()}
    p = fleet.plan(have, ready, want_hash, s.replicas, s.max_unavailable_groups or 1)
    for i in p.delete:   # highest index first; the GC deletes its pods, whose preStop drains them
        kube.delete_custom(GROUP, VERSION, PLURAL, namespace, children[i]["metadata"]["name"],
                           children[i]["metadata"]["uid"])
        logger.info(f"deleted group {children[i]['metadata']['name']}: spec.replicas is {s.replicas}")
    for i in p.create + p.update:
        child = fleet.child_body(name, namespace, i, spec, f"{GROUP}/{VERSION}", KIND)
        kopf.adopt(child, owner=body)
        kube.apply(child)
        logger.info(f"{'updated' if i in children else 'created'} group {child['metadata']['name']}")
        ready[i] = False
    live = [c for i, c in children.items() if i not in p.delete]
    live += [{"metadata": {"name": fleet.child_name(name, i), "labels": {fleet.LABEL_GROUP_INDEX: str(i)}}}
             for i in p.create]
    summary = fleet.summary(name, live, ready, s.replicas)
    behind = p.update or any(have.get(i) != want_hash for i in children if i < s.replicas)
    phase = Phase.RUNNING if summary["readyGroups"] == s.replicas and not behind and not p.create else \
        Phase.UPDATING if behind else Phase.STARTING
    patch.status.update({**summary, "phase": phase.value, "observedGeneration": meta.get("generation")})
    if any(c.get("type") == INVALID_SPEC for c in status.get("conditions") or []):
        patch.status["conditions"] = [c for c in status["conditions"] if c.get("type") != INVALID_SPEC]
