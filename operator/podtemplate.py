"""The engine pod's lifecycle and the user's full pod template, added to the template builders.py made:
the model's volume (storage.py), startup and liveness probes sized for a model load, a preStop that
drains, a grace period that covers the drain, then spec.podTemplate.template merged under it all."""
from __future__ import annotations

import math

from pdrollout.engine.protocol.shutdown import stop_bound_s
from pdrollout.operator import storage
from pdrollout.operator.models import PDRolloutSpec
from pdrollout.operator.podspec import ENGINE_CONTAINER, PodTemplateSpec

PROBE_PERIOD_S = 10
PROBE_TIMEOUT_S = 5
LIVENESS_FAILURES = 3
DRAIN_MODULE = "pdrollout.engine.server.lifecycle"


def grace_seconds(spec: PDRolloutSpec) -> int:
    """The engine's own bound on a stop (drain, abort, close), so the kubelet never kills it mid-drain."""
    return math.ceil(stop_bound_s(spec.lifecycle.drain_seconds))


def probes(spec: PDRolloutSpec) -> dict:
    """startup: /health (ready once the model is loaded and the group joined) for up to startupSeconds,
    before which liveness is not asked; liveness: /live, the step loop turned within livenessSeconds."""
    lc = spec.lifecycle
    every = {"periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": PROBE_TIMEOUT_S}
    return {
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, **every,
                         "failureThreshold": math.ceil(lc.startup_seconds / PROBE_PERIOD_S)},
        "livenessProbe": {"httpGet": {"path": f"/live?bound_s={lc.liveness_seconds}", "port": "http"}, **every,
                          "failureThreshold": LIVENESS_FAILURES},
    }


def pre_stop(spec: PDRolloutSpec) -> dict:
    """POST /drain on this pod (the admin token from its mounted file): the pod turns unready and stops
    admitting while in-flight requests finish; the SIGTERM after it counts its drain from the same start."""
    return {"preStop": {"exec": {"command": [
        "python3", "-m", DRAIN_MODULE, "drain", "--port", str(spec.port),
        "--timeout", str(grace_seconds(spec))]}}}


def _key(item):
    if isinstance(item, dict):
        for k in ("name", "mountPath", "containerPort"):
            if k in item:
                return k, item[k]
    return None


def under(user, ours):
    """`user` merged under `ours`: ours wins on every scalar; maps merge key by key; lists keep ours
    first, then the user's items whose name (mountPath, port) ours does not already have."""
    if isinstance(user, dict) and isinstance(ours, dict):
        return {**user, **{k: under(user[k], v) if k in user else v for k, v in ours.items()}}
    if isinstance(user, list) and isinstance(ours, list):
        keys = {_key(x) for x in ours}
        return ours + [x for x in user if (_key(x) not in keys if _key(x) else x not in ours)]
    return ours


def merge_template(tpl: dict, user: PodTemplateSpec | None) -> dict:
    if user is None:
        return tpl
    u = user.model_dump(by_alias=True, exclude_unset=True)   # as written: no defaults of ours added
    u_spec = dict(u.get("spec") or {})
    u_containers = u_spec.pop("containers", [])
    u_engine = next((c for c in u_containers if c["name"] == ENGINE_CONTAINER), None)
    sidecars = [c for c in u_containers if c["name"] != ENGINE_CONTAINER]
    pod = dict(tpl["spec"])
    ours_containers = pod.pop("containers")
    engine = under(u_engine, ours_containers[0]) if u_engine else ours_containers[0]
    # User init containers run first (they may put the model where the cache fill reads it).
    inits = u_spec.pop("initContainers", []) + pod.pop("initContainers", [])
    merged = under(u_spec, pod)
    merged["containers"] = [engine, *ours_containers[1:], *sidecars]
    if inits:
        merged["initContainers"] = inits
    meta = under(u.get("metadata") or {}, tpl["metadata"])
    return {**tpl, "metadata": meta, "spec": merged}


def own(tpl: dict, spec: PDRolloutSpec) -> dict:
    """The operator's template (builders.py) with the model's storage, probes, preStop and grace."""
    pod = tpl["spec"]
    engine = pod["containers"][0]
    # The cache fill copies files: the engine's CPU and memory, none of its GPUs or RDMA devices.
    plain = {k: {r: v for r, v in amounts.items() if r in ("cpu", "memory")}
             for k, amounts in engine["resources"].items()}
    got = storage.model_storage(spec.model.source, spec.model.path, spec.image, engine["securityContext"], plain)
    pod["volumes"] += got.volumes
    engine["volumeMounts"] += got.mounts
    if got.init_containers:
        pod["initContainers"] = got.init_containers
    engine.update(probes(spec))
    engine["lifecycle"] = pre_stop(spec)
    # An engine that exits on a bad config (a missing model) says why in its last lines: the
    # operator reads them back from the container's termination message.
    engine["terminationMessagePolicy"] = "FallbackToLogsOnError"
    pod["terminationGracePeriodSeconds"] = grace_seconds(spec)
    return tpl
