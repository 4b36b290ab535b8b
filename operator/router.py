"""spec.router: sglang-router (PyPI `sglang-router`) in front of the rollout's API pods, found by Kubernetes
service discovery on the rollout's labels (a pod joins once ready and drops out while it is recreated).
The model and the pure builders of its Deployment, ServiceAccount, Role and RoleBinding; the client
Service points at the router when it is on (builders.api_service)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from pdrollout.engine.protocol.router import ROUTER_IMAGE
from pdrollout.operator.podspec import QUANTITY

ROUTER_CONTAINER = "router"
ROUTER_UID = 65532
METRICS_PORT = 29000                      # sglang-router's --prometheus-port default
LABEL_ROUTER = "pdrollout.io/router"      # not LABEL_ROLLOUT: the router is no member of the engine group
# sglang-router 0.3.2's --policy choices
Policy = Literal["cache_aware", "round_robin", "power_of_two", "random", "manual"]


class Router(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    image: str = Field(default=ROUTER_IMAGE, min_length=1, description="An image with sglang-router installed.")
    policy: Policy = Field(default="cache_aware", description=(
        "sglang-router's load balancing: cache_aware keeps a session's turns on the engine holding its prefix; "
        "manual routes by a sticky routing key."))
    replicas: int = Field(default=1, ge=1, le=16, description="Router pods (each discovers every engine).")
    cpu: str = Field(default="1", min_length=1, pattern=QUANTITY)
    memory: str = Field(default="1Gi", min_length=1, pattern=QUANTITY)


def name_of(rollout: str) -> str:
    return f"{rollout}-router"


def router_labels(rollout: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "pdrollout-router", "app.kubernetes.io/instance": rollout,
            "app.kubernetes.io/managed-by": "pdrollout-operator", LABEL_ROUTER: rollout}


def worker_selector(rollout: str, rollout_label: str, index_label: str) -> dict[str, str]:
    """The API pods: node 0 of the rollout's group(s); the router takes only the ready ones."""
    return {rollout_label: rollout, index_label: "0"}


def args(rollout: str, namespace: str, router: Router, port: int, workers: dict[str, str]) -> list[str]:
    return ["-m", "sglang_router.launch_router", "--host", "0.0.0.0", "--port", str(port),
            "--policy", router.policy, "--service-discovery",
            "--selector", *(f"{k}={v}" for k, v in workers.items()),
            "--service-discovery-port", str(port), "--service-discovery-namespace", namespace,
            "--prometheus-host", "0.0.0.0", "--prometheus-port", str(METRICS_PORT)]


def _meta(rollout: str, namespace: str) -> dict:
    return {"name": name_of(rollout), "namespace": namespace, "labels": router_labels(rollout)}


def service_account(rollout: str, namespace: str) -> dict:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(rollout, namespace)}


def role(rollout: str, namespace: str) -> dict:
    """Discovery only: watch the namespace's pods (sglang-router lists them, then watches)."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(rollout, namespace),
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]}


def role_binding(rollout: str, namespace: str) -> dict:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": _meta(rollout, namespace),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name_of(rollout)},
            "subjects": [{"kind": "ServiceAccount", "name": name_of(rollout), "namespace": namespace}]}


def deployment(rollout: str, namespace: str, router: Router, port: int, workers: dict[str, str]) -> dict:
    amounts = {"cpu": router.cpu, "memory": router.memory}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(rollout, namespace),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": {LABEL_ROUTER: rollout}},
            "template": {
                "metadata": {"labels": router_labels(rollout)},
                "spec": {
                    "serviceAccountName": name_of(rollout),   # its token lists the pods, nothing more
                    "securityContext": {"runAsNonRoot": True, "runAsUser": ROUTER_UID, "runAsGroup": ROUTER_UID,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{   # python3: images built from python slim need not have `python`
                        "name": ROUTER_CONTAINER, "image": router.image, "command": ["python3"],
                        "args": args(rollout, namespace, router, port, workers),
                        # the metrics port's name is what the chart's router PodMonitor scrapes
                        "ports": [{"name": "http", "containerPort": port},
                                  {"name": "metrics", "containerPort": METRICS_PORT}],
                        "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 5},
                        "resources": {"requests": dict(amounts), "limits": dict(amounts)},
                        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                    }],
                },
            },
        },
    }


def objects(rollout: str, namespace: str, router: Router, port: int, workers: dict[str, str]) -> list[dict]:
    """In apply order: the identity and its grant before the pods that use them."""
    return [service_account(rollout, namespace), role(rollout, namespace), role_binding(rollout, namespace),
            deployment(rollout, namespace, router, port, workers)]


def stale(rollout: str, namespace: str) -> list[dict]:
    """What a rollout whose router was turned off may still have (deleted when this rollout owns it)."""
    built = objects(rollout, namespace, Router(), 1, {})
    return [{k: o[k] for k in ("apiVersion", "kind", "metadata")} for o in reversed(built)]
