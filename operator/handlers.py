"""kopf handlers: reconcile (create/update/resume) applies the builders' objects; the observer (observer.py,
every poll period, no finalizer) calls `observe` on the group (pods, rank 0's /health and /metrics), enforces group restarts, converges live controls and
writes status. Decisions live in the pure modules; this file only wires them to the API."""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
from dataclasses import dataclass
from datetime import datetime, timezone

import kopf
from pydantic import ValidationError

from pdrollout.operator import builders, engine_client, events, fleet_sync, group, kube, metrics, observer, router
from pdrollout.operator import status as st
from pdrollout.operator.models import GROUP, PLURAL, VERSION, ConditionType, PDRolloutSpec, Phase

INVALID_SPEC = ConditionType.INVALID_SPEC.value
CONFIG_ERROR = ConditionType.CONFIG_ERROR.value
REFUSED = "refused"   # memo key: (generation, the InvalidSpec condition) reconcile wrote for it


@dataclass(frozen=True)
class OperatorConfig:
    poll_s: float = 10.0                 # status/health/group check period per rollout
    restart_backoff_s: float = 10.0      # group restart backoff base (doubles per restart)
    restart_backoff_max_s: float = 300.0

    @classmethod
    def from_env(cls) -> "OperatorConfig":
        def f(key: str, default: float) -> float:
            raw = os.environ.get(f"PDROLLOUT_OPERATOR_{key}", default)
            try:
                value = float(raw)
            except ValueError:
                value = -1.0
            if not value > 0 and not (key.startswith("RESTART_BACKOFF") and value == 0):
                raise SystemExit(f"pdrollout-operator: PDROLLOUT_OPERATOR_{key}={raw!r} must be a positive "
                                 f"number of seconds")
            return value
        return cls(poll_s=f("POLL_S", cls.poll_s), restart_backoff_s=f("RESTART_BACKOFF_S", cls.restart_backoff_s),
                   restart_backoff_max_s=f("RESTART_BACKOFF_MAX_S", cls.restart_backoff_max_s))


CFG = OperatorConfig.from_env()
TOKEN_KEY_FILE_ENV = "PDROLLOUT_OPERATOR_TOKEN_KEY_FILE"
NAMESPACE_ENV = "PDROLLOUT_OPERATOR_NAMESPACE"
MIN_KEY_BYTES = 32


class SetupError(Exception):
    """The operator is missing what it needs to run (said before kopf starts)."""


@functools.cache
def token_key() -> bytes:
    """The key every rollout's admin token derives from (a Secret the chart keeps across upgrades)."""
    path = os.environ.get(TOKEN_KEY_FILE_ENV)
    if not path:
        raise SetupError(f"${TOKEN_KEY_FILE_ENV} (or --token-key-file) is required: the key the engines' "
                         f"admin tokens derive from")
    try:
        key = open(path, "rb").read().strip()
    except OSError as e:
        raise SetupError(f"token key file {path}: {e.strerror}") from None
    if len(key) < MIN_KEY_BYTES:
        raise SetupError(f"token key file {path} holds {len(key)} bytes; at least {MIN_KEY_BYTES} are needed")
    return key


@functools.cache
def operator_namespace() -> str:
    """Where the operator's pods run (the engines' NetworkPolicy admits them from there)."""
    ns = os.environ.get(NAMESPACE_ENV)
    if not ns:
        try:
            ns = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read().strip()
        except OSError:
            raise SetupError(f"${NAMESPACE_ENV} is required outside a pod: the operator's namespace") from None
    return ns


_DNS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def cluster_domain() -> str:
    """The DNS domain the layout's master address ends in (said wrong, no rank finds node 0)."""
    if not _DNS_NAME.match(builders.CLUSTER_DOMAIN) or len(builders.CLUSTER_DOMAIN) > 253:
        raise SetupError(f"${builders.CLUSTER_DOMAIN_ENV}={builders.CLUSTER_DOMAIN!r} is not a DNS domain "
                         f"(e.g. cluster.local)")
    return builders.CLUSTER_DOMAIN


def rollout_token(namespace: str, name: str, uid: str) -> str:
    return builders.admin_token(token_key(), namespace, name, uid)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _spec(spec) -> PDRolloutSpec:
    try:
        return PDRolloutSpec.model_validate(dict(spec))
    except ValidationError as e:  # the CRD should have refused it; retrying cannot help
        raise kopf.PermanentError(f"invalid spec: {e}") from None


def _selector(name: str) -> str:
    return f"{builders.LABEL_ROLLOUT}={name}"


def _running(pods: list[dict]) -> list[dict]:
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") == "Running" and (p.get("status") or {}).get("podIP")]


def _ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    # Bounded watches: the server ends each one and kopf re-lists, so a lost connection, an API server
    # restart or 410 Gone only delays events by at most this long.
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 30
    settings.posting.level = logging.INFO
    # No handler needs a finalizer (observe runs in observer.py, not as a kopf timer); the name stays set so
    # that kopf removes the one an older operator put on existing rollouts.
    # The CRD is installed before the operator (Helm's crds/); no need to watch CRDs, nor the RBAC for it.
    settings.scanning.disabled = True


WATCHED: list[str] = []   # the namespaces the operator serves (empty: all); set by __main__


@kopf.on.startup()
async def start_observer(memo: kopf.Memo, **_) -> None:
    watcher = observer.Observer(observe, gone, WATCHED, CFG.poll_s, min(CFG.poll_s, 2.0))
    memo["observer"] = asyncio.create_task(watcher.run(), name="observer")


@kopf.on.cleanup()
async def stop_observer(memo: kopf.Memo, **_) -> None:
    task = memo.get("observer")
    if task:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _node0(name: str, pods: list[dict]) -> dict | None:
    """The running pod of node 0: it plans for the whole group and serves the API."""
    return next((p for p in _running(pods) if p["metadata"]["name"] == f"{name}-0"), None)


def push_control(namespace: str, name: str, uid: str, spec: PDRolloutSpec, logger,
                 pods: list[dict] | None = None) -> bool:
    """Bring the engine's /control to spec.multiplexing. Node 0 takes it for every rank of every node
    (the control travels in its step plans). True when node 0 agrees."""
    want = spec.multiplexing.control().model_dump()
    pod = _node0(name, kube.list_pods(namespace, _selector(name)) if pods is None else pods)
    if pod is None:
        return False
    url = engine_client.base_url(pod["status"]["podIP"], spec.port)
    try:
        have = engine_client.get_control(url)
        if {k: have.get(k) for k in want} != want:
            engine_client.put_control(url, want, rollout_token(namespace, name, uid))
            logger.info(f"pushed control {want} to {pod['metadata']['name']}")
        return True
    except engine_client.EngineError as e:  # observe retries; the ConfigMap holds it for restarts
        logger.warning(f"control not pushed to {pod['metadata']['name']}: {e}")
        return False


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile(spec, name, namespace, body, meta, status, memo, patch, logger, retry, **_) -> None:
    memo = observer.memo_for(meta["uid"], memo)
    try:
        _reconcile(spec, name, namespace, body, meta, status, memo, patch, logger)
    except kube.NamespaceTerminating as e:   # the rollout goes with its namespace: nothing to apply
        logger.debug(f"not reconciled: {e}")
    except kube.Forbidden as e:   # back off: the fix (RBAC) comes from outside, maybe much later
        metrics.COLLECTOR.reconcile_error(namespace, name)
        delay = kube.forbidden_delay(retry)
        raise kopf.TemporaryError(f"{e}; retry {retry + 1} in {delay:.0f} s", delay=delay) from None
    except Exception:
        metrics.COLLECTOR.reconcile_error(namespace, name)
        raise


def gone(namespace: str, name: str, uid: str) -> None:
    """A rollout deleted (the observer no longer lists it): its metrics and memo go too. Not a kopf deletion
    handler: without a finalizer kopf need not run one for an object that is simply gone."""
    metrics.COLLECTOR.forget(namespace, name)
    observer.forget(uid)


def _export(namespace: str, name: str, s: PDRolloutSpec, status: dict, patch, phase: str, pods: list[dict],
            ready: int) -> None:
    """What the operator's /metrics says of this rollout (the status counters as this tick leaves them)."""
    def now(key: str) -> int:
        return int(patch.status.get(key) if patch.status.get(key) is not None else status.get(key) or 0)
    metrics.COLLECTOR.observed(namespace, name, metrics.RolloutSeen(
        phase=phase, desired_pods=s.topology.nodes, ready_pods=ready, pods=metrics.pod_phases(pods),
        stalls=now("stalls"), group_restarts=now("groupRestarts")))


def _reconcile(spec, name, namespace, body, meta, status, memo, patch, logger) -> None:
    memo.pop(REFUSED, None)   # this generation is judged afresh
    s = _spec(spec)
    if s.replicas is not None:   # a fleet: its groups are child PDRollouts, each reconciled as one
        return fleet_sync.sync(name, namespace, spec, s, body, meta, dict(status or {}), patch, logger)
    fleet_sync.leave(name, namespace, meta["uid"], logger)
    objs = builders.desired_objects(name, namespace, s, rollout_token(namespace, name, meta["uid"]),
                                    operator_namespace())
    kopf.adopt(objs, owner=body)
    conditions = [c for c in (status or {}).get("conditions") or [] if c.get("type") != INVALID_SPEC]
    taken = [f"{o['kind']} {o['metadata']['name']}" for o in objs if kube.foreign(o, meta["uid"])]
    if taken:
        _name_conflict(taken, conditions, (status or {}).get("conditions") or [], memo, patch, body, meta, logger)
    for obj in objs:
        try:
            kube.apply(obj)
        except kube.Refused as e:
            # Retrying cannot help; say why where users look, and wait for a spec change (an update).
            message = f"{obj['kind']} {obj['metadata']['name']} refused by the API server: {e.message}"
            refused = {"type": INVALID_SPEC, "status": "True", "reason": "ObjectRefused", "message": message[:1000],
                       "lastTransitionTime": _iso(_now())}
            memo[REFUSED] = (meta.get("generation"), refused)   # observe re-asserts it
            _patch_refused(patch, conditions, refused, meta)
            events.warn(body, reason=INVALID_SPEC, message=message)
            logger.error(message)
            return
        logger.info(f"applied {obj['kind']} {obj['metadata']['name']}")
    if not s.router:   # turned off (or never on): remove what this rollout's router left, never another's
        for obj in router.stale(name, namespace):
            if not kube.foreign(obj, meta["uid"]) and kube.delete(obj):
                logger.info(f"deleted {obj['kind']} {obj['metadata']['name']}: spec.router is unset")
    if len(conditions) != len((status or {}).get("conditions") or []):
        patch.status["conditions"] = conditions       # the spec is runnable again
        patch.status["phase"] = Phase.STARTING.value
    if push_control(namespace, name, meta["uid"], s, logger):
        patch.status["control"] = s.multiplexing.model_dump(by_alias=True)
    patch.status["observedGeneration"] = meta.get("generation")
    if not (status or {}).get("phase"):
        patch.status["phase"] = Phase.STARTING.value


def _name_conflict(taken: list[str], conditions: list[dict], had: list[dict], memo, patch, body, meta,
                   logger) -> None:
    """Objects of the derived names exist and are not this rollout's: apply nothing (force would take
    them over, and deleting the rollout would garbage-collect them), say so, and look again later (the
    other object may go)."""
    message = (f"name taken by an object this PDRollout does not own ({', '.join(taken)}): left untouched; "
               f"rename the PDRollout or remove that object")
    said = next((c for c in had if c.get("reason") == "NameConflict" and c.get("message") == message[:1000]), None)
    refused = {"type": INVALID_SPEC, "status": "True", "reason": "NameConflict", "message": message[:1000],
               "lastTransitionTime": (said or {}).get("lastTransitionTime") or _iso(_now())}
    memo[REFUSED] = (meta.get("generation"), refused)
    _patch_refused(patch, conditions, refused, meta)
    if said is None:   # once, not on every retry
        events.warn(body, reason="NameConflict", message=message)
    logger.error(message)
    raise kopf.TemporaryError(message, delay=max(CFG.poll_s, 5.0))


def _patch_refused(patch, conditions: list[dict], refused: dict, meta) -> None:
    patch.status["conditions"] = conditions + [refused]
    patch.status["phase"] = Phase.FAILED.value
    patch.status["observedGeneration"] = meta.get("generation")


def _group_restart(s: PDRolloutSpec, pods: list[dict], status: dict, memo, namespace: str, body, patch,
                   logger) -> str | None:
    """Apply RecreateGroupOnPodRestart. Returns why the group is restarting, or None."""
    # The memo is current within this process, also when it holds "none yet" right after a restart: an
    # observer tick's body can trail this process's own last status patch, and its stale groupPods would make
    # the new group's pods look recreated alone. Status carries the record across operator restarts.
    recorded = memo["group_pods"] if "group_pods" in memo else status.get("groupPods")
    fault = group.group_fault(pods, recorded)
    if s.restart_policy != "RecreateGroupOnPodRestart" or fault is None:
        members = group.membership(pods, s.topology.nodes)
        if members and members != recorded:
            memo["group_pods"] = members
            patch.status["groupPods"] = members
        return None
    streak = status.get("restartStreak") or 0
    d = group.decide_restart(fault, streak, status.get("lastGroupRestartTime"), _now(),
                             CFG.restart_backoff_s, CFG.restart_backoff_max_s)
    if d.restart_now:
        kube.delete_pods(namespace, group.live(pods))
        memo["group_pods"] = None
        patch.status["groupPods"] = None
        patch.status["groupRestarts"] = (status.get("groupRestarts") or 0) + 1
        patch.status["restartStreak"] = streak + 1
        patch.status["lastGroupRestartTime"] = _iso(_now())
        events.warn(body, reason="GroupRestart", message=d.reason)
        logger.warning(d.reason)
    return d.reason


def _group_update(name: str, namespace: str, s: PDRolloutSpec, pods: list[dict], status: dict, meta, memo,
                  body, patch, logger) -> tuple[str | None, bool]:
    """A changed pod template is an update, not a fault: recreate the whole group on it at once (the
    StatefulSet is OnDelete), say so with a Normal event, and report progress until every pod on the
    new template is ready. Returns (Progressing message or None, whether pods were deleted now)."""
    if status.get("observedGeneration") != meta.get("generation"):
        return None, False    # reconcile has not applied this generation's StatefulSet yet
    want = builders.template_hash(name, namespace, s)
    live = group.live(pods)
    old = [p for p in live if (p["metadata"].get("annotations") or {}).get(builders.TEMPLATE_HASH) != want]
    if old:
        message = (f"pod template changed: recreating the group on it ({len(old)} of {len(live)} pod(s) "
                   f"on the old template)")
        if status.get("updatingTo") != want:   # first sight of this change
            patch.status["groupUpdates"] = (status.get("groupUpdates") or 0) + 1
            events.normal(body, reason="GroupUpdate", message=message)
            logger.info(message)
        kube.delete_pods(namespace, live)      # together: the ranks rendezvous as one group
        memo["group_pods"] = None
        patch.status["groupPods"] = None
        patch.status["updatingTo"] = want
        return message, True
    if status.get("updatingTo"):
        ready = sum(1 for p in _running(pods) if _ready(p))
        if ready < s.topology.nodes:
            return f"group on the new pod template: {ready}/{s.topology.nodes} pods ready", False
        patch.status["updatingTo"] = None
    return None, False


def _stall_exit(pods: list[dict], status: dict, patch, body) -> str | None:
    """An engine exit with the stall code not counted yet: count it, say so, return its message."""
    seen = group.stall_exit(pods)
    if seen is None or seen[0] == status.get("lastStallExit"):
        return None
    key, message = seen
    patch.status["stalls"] = (status.get("stalls") or 0) + 1
    patch.status["lastStallExit"] = key
    patch.status["lastStallTime"] = _iso(_now())
    events.warn(body, reason="EngineStalled", message=message)
    return message


def observe(spec, name, namespace, body, meta, status, memo, patch, logger, stopped, **_) -> None:
    if stopped:  # the rollout is being deleted (or the operator is exiting): no more engine calls
        return
    s = _spec(spec)
    status = dict(status or {})
    conditions = status.get("conditions") or []
    said = any(c.get("type") == INVALID_SPEC and c.get("status") == "True" for c in conditions)
    generation, refused = memo.get(REFUSED) or (None, None)
    if refused is not None and generation == meta.get("generation"):
        # observe runs beside the change handlers: a tick that read status before reconcile's
        # refusal landed writes its conditions list after it and drops InvalidSpec. This process's
        # memo still knows; say it again (one tick later) rather than lose it until the next spec change.
        if not said:
            logger.warning(f"re-asserting InvalidSpec: {refused['message']}")
            _patch_refused(patch, [c for c in conditions if c.get("type") != INVALID_SPEC], refused, meta)
        _export(namespace, name, s, status, patch, Phase.FAILED.value, [], 0)
        return
    if said:
        _export(namespace, name, s, status, patch, Phase.FAILED.value, [], 0)
        return  # nothing runs until the spec changes (reconcile clears the condition)
    if s.replicas is not None:
        return fleet_sync.sync(name, namespace, spec, s, body, meta, status, patch, logger)
    pods = kube.list_pods(namespace, _selector(name))
    logger.debug("pods: " + ", ".join(
        f"{p['metadata']['name']}({p['metadata']['uid'][:8]} {(p.get('status') or {}).get('phase')}"
        f"{' deleting' if p['metadata'].get('deletionTimestamp') else ''}{' ready' if _ready(p) else ''})"
        for p in pods))
    stall = _stall_exit(pods, status, patch, body)   # before a restart replaces the pods that say so
    updating, replaced = _group_update(name, namespace, s, pods, status, meta, memo, body, patch, logger)
    restarting = None if replaced else _group_restart(s, pods, status, memo, namespace, body, patch, logger)
    ready = 0 if restarting or replaced else sum(1 for p in _running(pods) if _ready(p))
    health = metrics = version = None
    rank0 = _node0(name, pods)
    if not restarting and not updating and ready == s.topology.nodes and rank0 is not None:
        url = engine_client.base_url(rank0["status"]["podIP"], s.port)
        health = engine_client.health(url)
        if stopped:
            return
        if health.reachable:
            try:
                metrics = engine_client.metrics(url)
            except engine_client.EngineError as e:
                logger.warning(f"metrics unavailable: {e}")
        if health.ok:
            try:
                version = engine_client.weight_version(url)
            except engine_client.EngineError as e:
                logger.warning(f"weight version unavailable: {e}")
        if health.ok and push_control(namespace, name, meta["uid"], s, logger, pods):
            patch.status["control"] = s.multiplexing.model_dump(by_alias=True)
    previous = next((c for c in status.get("conditions") or [] if c.get("type") == "Stalled"), None)
    config = next((c for c in status.get("conditions") or [] if c.get("type") == CONFIG_ERROR), None)
    obs = st.Observation(desired_nodes=s.topology.nodes, ready_nodes=ready,
                         generation=meta.get("generation"), observed_generation=status.get("observedGeneration"),
                         health=health, metrics=metrics, restarting=restarting, updating=updating, stall=stall,
                         previous_stalled=previous, weight_version=version,
                         config_error=group.config_exit(pods), previous_config=config)
    phase, conds = st.decide(obs)
    patch.status.update(st.status_patch(obs, phase, st.merge_conditions(status.get("conditions"), conds,
                                                                        _iso(_now()))))
    _export(namespace, name, s, status, patch, phase.value, pods, ready)
    if phase is Phase.RUNNING and status.get("restartStreak"):
        patch.status["restartStreak"] = 0
    if phase.value != status.get("phase"):
        ok = phase in (Phase.RUNNING, Phase.STARTING, Phase.UPDATING)
        ready_cond = next(c for c in conds if c.type.value == "Ready")
        events.post(body, type="Normal" if ok else "Warning", reason=phase.value,
                   message=f"{status.get('phase') or 'None'} -> {phase.value}: {ready_cond.message or ready_cond.reason}")

