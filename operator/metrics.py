"""The operator's own Prometheus metrics: what it sees of each rollout, kept for as long as the
rollout exists, so an alert sees a stall or a Pending pod whatever the scrape timing (an engine's own
counters die with its process seconds after a stall).

Counters that the status persists (stalls, group restarts) are exported from the status, so they
survive an operator restart or failover and never go backwards; reconcile errors are this process's."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdrollout.operator.models import Phase

POD_PHASES = ("Pending", "Running", "Succeeded", "Failed", "Unknown")
PREFIX = "pdrollout_operator"


@dataclass
class RolloutSeen:
    phase: str = Phase.STARTING.value
    desired_pods: int = 0
    ready_pods: int = 0
    pods: dict[str, int] = field(default_factory=dict)   # pod phase -> count of live pods
    stalls: int = 0
    group_restarts: int = 0


class OperatorCollector:
    """Collects at scrape time from what the handlers last recorded (no per-series bookkeeping)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._rollouts: dict[tuple[str, str], RolloutSeen] = {}
        self._errors: dict[tuple[str, str], int] = {}

    def observed(self, namespace: str, name: str, seen: RolloutSeen) -> None:
        with self._lock:
            self._rollouts[(namespace, name)] = seen

    def reconcile_error(self, namespace: str, name: str) -> None:
        with self._lock:
            self._errors[(namespace, name)] = self._errors.get((namespace, name), 0) + 1

    def forget(self, namespace: str, name: str) -> None:
        """The rollout is gone: its series end (a stale phase would keep alerts firing)."""
        with self._lock:
            self._rollouts.pop((namespace, name), None)
            self._errors.pop((namespace, name), None)

    def collect(self):
        with self._lock:
            rollouts, errors = dict(self._rollouts), dict(self._errors)
        key = ["namespace", "rollout"]
        phase = GaugeMetricFamily(f"{PREFIX}_rollout_phase", "1 for the rollout's current phase, 0 for the others.",
                                  labels=key + ["phase"])
        pods = GaugeMetricFamily(f"{PREFIX}_group_pods", "Live (not deleting) pods of the group by pod phase.",
                                 labels=key + ["phase"])
        desired = GaugeMetricFamily(f"{PREFIX}_group_desired_pods", "Pods the group needs (spec.topology.nodes).",
                                    labels=key)
        ready = GaugeMetricFamily(f"{PREFIX}_group_ready_pods", "Running and Ready pods of the group.", labels=key)
        stalls = CounterMetricFamily(f"{PREFIX}_engine_stalls", "Engine exits with the stall code (exit 3) seen "
                                     "in the pods' last-terminated state (status.stalls).", labels=key)
        restarts = CounterMetricFamily(f"{PREFIX}_group_restarts", "Whole-group restarts the operator made "
                                       "(status.groupRestarts).", labels=key)
        failed = CounterMetricFamily(f"{PREFIX}_reconcile_errors", "Reconciles of the rollout that failed (this "
                                     "operator process).", labels=key)
        for (ns, name), s in sorted(rollouts.items()):
            for p in Phase:
                phase.add_metric([ns, name, p.value], 1.0 if s.phase == p.value else 0.0)
            for p in POD_PHASES:
                pods.add_metric([ns, name, p], float(s.pods.get(p, 0)))
            desired.add_metric([ns, name], float(s.desired_pods))
            ready.add_metric([ns, name], float(s.ready_pods))
            stalls.add_metric([ns, name], float(s.stalls))
            restarts.add_metric([ns, name], float(s.group_restarts))
        for (ns, name), n in sorted(errors.items()):
            failed.add_metric([ns, name], float(n))
        return [phase, pods, desired, ready, stalls, restarts, failed]


COLLECTOR = OperatorCollector()
REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(COLLECTOR)


def pod_phases(pods: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in pods:
        if p["metadata"].get("deletionTimestamp"):
            continue
        phase = (p.get("status") or {}).get("phase") or "Unknown"
        out[phase] = out.get(phase, 0) + 1
    return out


def serve(address: str):
    """Serve /metrics on HOST:PORT (a thread); returns the server so a caller may stop it."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError("want HOST:PORT, e.g. 0.0.0.0:8081")
    server, _thread = start_http_server(int(port), addr=host, registry=REGISTRY)
    return server
