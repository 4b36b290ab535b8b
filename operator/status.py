"""What the status says, as pure functions of what the operator observed: phase, conditions, counts."""
from __future__ import annotations

from dataclasses import dataclass

from pdrollout.operator.engine_client import EngineMetrics, Health
from pdrollout.operator.models import Condition, ConditionType, Phase


@dataclass(frozen=True)
class Observation:
    desired_nodes: int
    ready_nodes: int
    generation: int | None
    observed_generation: int | None
    health: Health | None = None          # None: not polled (pods not all ready)
    metrics: EngineMetrics | None = None
    restarting: str | None = None         # why the group is being recreated, if it is
    updating: str | None = None           # the group is being recreated on a new pod template
    stall: str | None = None              # an engine exited with the stall code (seen this pass)
    previous_stalled: dict | None = None  # the Stalled condition as status had it
    weight_version: str | None = None     # node 0's engine's, when it answered
    config_error: str | None = None       # an engine/model-cache exit with the config code, its last words
    previous_config: dict | None = None   # the ConfigError condition as status had it


def _cond(t: ConditionType, ok: bool, reason: str, message: str = "") -> Condition:
    return Condition(type=t, status="True" if ok else "False", reason=reason, message=message)


def decide(o: Observation) -> tuple[Phase, list[Condition]]:
    """Phase and the four conditions; reasons are CamelCase words users can grep for."""
    behind = o.observed_generation is not None and o.generation is not None \
        and o.observed_generation < o.generation
    pods = f"{o.ready_nodes}/{o.desired_nodes} pods ready"

    if o.restarting:
        phase = Phase.RESTARTING
        conds = [_cond(ConditionType.READY, False, "GroupRestarting", o.restarting),
                 _cond(ConditionType.PROGRESSING, True, "GroupRestarting", o.restarting),
                 _cond(ConditionType.DEGRADED, True, "GroupRestarting", o.restarting)]
    elif o.updating:   # a planned change, not a fault: not Degraded
        phase = Phase.UPDATING
        conds = [_cond(ConditionType.READY, False, "GroupUpdating", o.updating),
                 _cond(ConditionType.PROGRESSING, True, "GroupUpdating", o.updating),
                 _cond(ConditionType.DEGRADED, False, "GroupUpdating", o.updating)]
    elif o.ready_nodes < o.desired_nodes:
        phase = Phase.STARTING
        conds = [_cond(ConditionType.READY, False, "PodsNotReady", pods),
                 _cond(ConditionType.PROGRESSING, True, "PodsStarting", pods),
                 _cond(ConditionType.DEGRADED, False, "PodsStarting", pods)]
    elif o.health is None:
        phase = Phase.STARTING
        conds = [_cond(ConditionType.READY, False, "HealthUnknown", "rank 0 not polled yet"),
                 _cond(ConditionType.PROGRESSING, True, "AwaitingHealth", pods),
                 _cond(ConditionType.DEGRADED, False, "AwaitingHealth", pods)]
    elif not o.health.ok:
        phase = Phase.DEGRADED
        reason = "EngineUnhealthy" if o.health.reachable else "EngineUnreachable"
        conds = [_cond(ConditionType.READY, False, reason, o.health.detail),
                 _cond(ConditionType.PROGRESSING, behind, "Reconciling" if behind else "PodsReady", pods),
                 _cond(ConditionType.DEGRADED, True, reason, o.health.detail)]
    else:
        phase = Phase.RUNNING
        conds = [_cond(ConditionType.READY, True, "EngineHealthy", o.health.detail),
                 _cond(ConditionType.PROGRESSING, behind, "Reconciling" if behind else "Converged", pods),
                 _cond(ConditionType.DEGRADED, False, "EngineHealthy")]
    return phase, conds + [stall_condition(o, phase)] + config_condition(o, phase)


def config_condition(o: Observation, phase: Phase) -> list[Condition]:
    """ConfigError, only once there was one: True with the engine's own words (a missing model says its
    path) from the exit until the group runs; the restarts in between (with backoff) would hide it."""
    prev = o.previous_config or {}
    if o.config_error:
        return [_cond(ConditionType.CONFIG_ERROR, True, "EngineConfigExit", o.config_error)]
    if prev.get("status") == "True" and phase is not Phase.RUNNING:
        return [_cond(ConditionType.CONFIG_ERROR, True, prev.get("reason") or "EngineConfigExit",
                      prev.get("message", ""))]
    if prev:
        return [_cond(ConditionType.CONFIG_ERROR, False, "Resolved", "running")]
    return []


def stall_condition(o: Observation, phase: Phase) -> Condition:
    """True from an engine's exit with the stall code until the group runs healthy again (the
    restart that follows a stall would otherwise hide it)."""
    prev = o.previous_stalled or {}
    if o.stall:
        return _cond(ConditionType.STALLED, True, "EngineStalled", o.stall)
    if prev.get("status") == "True" and phase is not Phase.RUNNING:
        return _cond(ConditionType.STALLED, True, prev.get("reason") or "EngineStalled", prev.get("message", ""))
    if prev.get("status") == "True":
        return _cond(ConditionType.STALLED, False, "Recovered", f"running again after: {prev.get('message', '')}")
    return _cond(ConditionType.STALLED, False, "NoStall")


def merge_conditions(old: list[dict], new: list[Condition], now: str) -> list[dict]:
    """Keep lastTransitionTime while a condition's status is unchanged (the Kubernetes convention)."""
    before = {c.get("type"): c for c in old or []}
    out = []
    for c in new:
        prev = before.get(c.type.value)
        since = prev.get("lastTransitionTime") if prev and prev.get("status") == c.status else now
        out.append(c.model_copy(update={"last_transition_time": since or now})
                   .model_dump(by_alias=True, mode="json"))
    return out


def status_patch(o: Observation, phase: Phase, conds: list[dict]) -> dict:
    patch: dict = {"phase": phase.value, "readyNodes": o.ready_nodes, "conditions": conds}
    if o.weight_version is not None:   # kept while the engine is away
        patch["weightVersion"] = o.weight_version
    m = o.metrics
    if m is not None:  # keep the last known figures while the engine is away
        # Rounded to what a person reads (ms; µs for the decode wait), not 24.872143999999935.
        for key, value, digits in (("makespanSeconds", m.makespan_s, 3),
                                   ("recentTtftP99Seconds", m.recent_ttft_p99_s, 3),
                                   ("meanDecodeWaitSeconds", m.mean_decode_wait_s, 6)):
            if value is not None:
                patch[key] = round(value, digits)
    return patch
