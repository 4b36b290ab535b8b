"""All-or-nothing group semantics (LeaderWorkerSet's RecreateGroupOnPodRestart): when any pod of a
rollout fails, restarts a container, or was recreated alone, every pod of the group is recreated, so
the ranks rendezvous again from scratch. "Recreated alone" is seen by UID: the operator records the
pods of each complete incarnation. Pure decisions here; the handler does the deleting."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pdrollout.engine.protocol.exits import EXIT_CONFIG, EXIT_STALL, name as exit_name
from pdrollout.operator.builders import ENGINE_CONTAINER


def _ts(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None


def pod_failure(pod: dict) -> str | None:
    """Why this pod breaks its group, or None. Pods already being deleted are on their way out."""
    meta, status = pod.get("metadata", {}), pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return None
    name = meta.get("name", "?")
    if status.get("phase") == "Failed":
        return f"pod {name} failed ({status.get('reason') or 'no reason given'})"
    for cs in status.get("containerStatuses") or []:
        code = last_exit(cs)
        why = f": exit {code} ({exit_name(code)})" if code is not None else ""
        if cs.get("restartCount", 0) > 0:
            return f"container {cs.get('name')} of pod {name} restarted ({cs['restartCount']}x{why})"
        if (cs.get("state") or {}).get("terminated"):
            return f"container {cs.get('name')} of pod {name} terminated{why}"
    return None


def _terminated(cs: dict) -> dict | None:
    """The container's current termination, else its last one (it restarted since)."""
    return (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")


def last_exit(cs: dict) -> int | None:
    term = _terminated(cs)
    return term.get("exitCode") if term else None


def stall_exit(pods: list[dict]) -> tuple[str, str] | None:
    """(key, message) of an engine that exited with the stall code (distributed/exits.py), if any:
    the watchdog's verdict, which a group restart would otherwise hide. The key tells one exit from
    the next (pod UID, container restarts, finish time)."""
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            if cs.get("name") != ENGINE_CONTAINER or last_exit(cs) != EXIT_STALL:
                continue
            term = _terminated(cs)
            key = f"{pod['metadata']['uid']}/{cs.get('restartCount', 0)}/{term.get('finishedAt')}"
            when = f" at {term['finishedAt']}" if term.get("finishedAt") else ""
            return key, (f"engine of pod {pod['metadata']['name']} exited with the stall code {EXIT_STALL}{when}: "
                         "no rank made progress within the watchdog bound (the pod's log has every rank's frontier)")
    return None


def config_exit(pods: list[dict]) -> str | None:
    """An engine or init container (the model cache's fill) whose last exit was the config code, with
    its last words: the termination message (FallbackToLogsOnError: the log's tail) ends with the
    engine's one-line verdict, e.g. the model path it could not read."""
    for pod in sorted(live(pods), key=lambda p: p["metadata"]["name"]):
        status = pod.get("status") or {}
        for kind, key in (("init container", "initContainerStatuses"), ("container", "containerStatuses")):
            for cs in status.get(key) or []:
                if last_exit(cs) != EXIT_CONFIG:
                    continue
                lines = [ln.strip() for ln in (_terminated(cs).get("message") or "").splitlines() if ln.strip()]
                words = lines[-1][:600] if lines else "no message (see the container's log)"
                return (f"{kind} {cs.get('name')} of pod {pod['metadata']['name']} exited with the config code "
                        f"{EXIT_CONFIG}: {words}")
    return None


def live(pods: list[dict]) -> list[dict]:
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def membership(pods: list[dict], nodes: int) -> dict[str, str] | None:
    """Pod name -> UID of a complete group (all `nodes` pods exist), else None."""
    members = {p["metadata"]["name"]: p["metadata"]["uid"] for p in live(pods)}
    return members if len(members) == nodes else None


def recreated_alone(recorded: dict[str, str] | None, pods: list[dict]) -> str | None:
    """A pod whose UID differs from the one recorded for this incarnation was deleted and recreated
    (by the StatefulSet controller, after a failure, eviction or a manual delete) without its peers."""
    for pod in sorted(live(pods), key=lambda p: p["metadata"]["name"]):
        name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
        if recorded and name in recorded and recorded[name] != uid:
            return f"pod {name} was recreated without its group"
    return None


def group_fault(pods: list[dict], recorded: dict[str, str] | None = None) -> str | None:
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        if reason := pod_failure(pod):
            return reason
    return recreated_alone(recorded, pods)


def backoff_s(streak: int, base_s: float, cap_s: float) -> float:
    """Delay before the next group restart after `streak` restarts without reaching Running:
    the first is immediate, then base, 2·base, 4·base … up to cap."""
    if streak <= 0:
        return 0.0
    return min(cap_s, base_s * 2 ** (streak - 1))


@dataclass(frozen=True)
class RestartDecision:
    restart_now: bool
    wait_s: float
    reason: str


def decide_restart(fault: str, streak: int, last_restart: str | None, now: datetime,
                   base_s: float, cap_s: float) -> RestartDecision:
    wait = backoff_s(streak, base_s, cap_s)
    last = _ts(last_restart)
    remaining = wait - (now - last).total_seconds() if last else 0.0
    if remaining > 0:
        return RestartDecision(False, remaining, f"{fault}; group restart #{streak + 1} in {remaining:.0f}s (backoff)")
    return RestartDecision(True, 0.0, f"{fault}; recreating the whole group")
