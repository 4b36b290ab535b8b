"""Ownership on the real API server: the operator applies with force only onto objects its rollout
owns. A PDRollout whose derived names are taken by other objects says so and leaves them alone (also
when it is deleted: the garbage collector must not take them with it)."""
import json
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]


def _cond(obj: dict, type_: str) -> dict:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_), {})


def _untouched(cluster, ns: str, kind: str, name: str, before: dict) -> None:
    now = cluster.get(kind, name, "-n", ns)
    assert now["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"], \
        f"{kind}/{name} was written: {json.dumps(now['metadata'])[:800]}"
    assert not now["metadata"].get("ownerReferences"), now["metadata"]


def test_rollout_named_over_foreign_objects_leaves_them_alone(cluster, operator, namespace, wait):
    name = "taken"
    # A Service and a Secret of the names the rollout derives, made by someone else.
    cluster.kubectl("create", "service", "clusterip", name, "-n", namespace, "--tcp=80:8080")
    cluster.kubectl("create", "secret", "generic", f"{name}-admin", "-n", namespace,
                    "--from-literal=token=not-the-rollouts")
    service = cluster.get("service", name, "-n", namespace)
    secret = cluster.get("secret", f"{name}-admin", "-n", namespace)

    doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())
    doc["metadata"]["name"] = name
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    def rollout_if(pred):
        return lambda: r if pred(r := cluster.get("pdrollout", name, "-n", namespace)) else None

    pdr = wait("the NameConflict condition", rollout_if(lambda r: _cond(r, "InvalidSpec").get("reason") == "NameConflict"),
               timeout=60)
    c = _cond(pdr, "InvalidSpec")
    assert c["status"] == "True" and pdr["status"]["phase"] == "Failed"
    assert f"Service {name}" in c["message"] and f"Secret {name}-admin" in c["message"], c["message"]
    events = cluster.get("events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")["items"]
    assert any(e["reason"] == "NameConflict" and e["type"] == "Warning" for e in events), events

    time.sleep(3)   # several timer ticks and at least one retry of the reconcile
    _untouched(cluster, namespace, "service", name, service)
    _untouched(cluster, namespace, "secret", f"{name}-admin", secret)
    assert cluster.kubectl("get", "statefulset", name, "-n", namespace, check=False).returncode != 0, \
        "nothing of the rollout is applied while its names are taken"
    assert _cond(cluster.get("pdrollout", name, "-n", namespace), "InvalidSpec")["reason"] == "NameConflict"

    # Deleting the rollout leaves the foreign objects where they were.
    cluster.kubectl("delete", "pdrollout", name, "-n", namespace, "--wait=true", "--timeout=60s", timeout=90)
    time.sleep(3)   # the garbage collector acts within a second or two on what it owns
    _untouched(cluster, namespace, "service", name, service)
    _untouched(cluster, namespace, "secret", f"{name}-admin", secret)

    # Once the other objects go, the retried reconcile applies the rollout's own (no spec change needed).
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    wait("the NameConflict again", lambda: _cond(cluster.get("pdrollout", name, "-n", namespace),
                                                 "InvalidSpec").get("reason") == "NameConflict", timeout=60)
    cluster.kubectl("delete", "service", name, "-n", namespace)
    cluster.kubectl("delete", "secret", f"{name}-admin", "-n", namespace)
    wait("the StatefulSet after the names are free",
         lambda: cluster.kubectl("get", "statefulset", name, "-n", namespace, check=False).returncode == 0,
         timeout=60)
    pdr = wait("NameConflict cleared", rollout_if(lambda r: not _cond(r, "InvalidSpec")
                                                  and r.get("status", {}).get("phase") != "Failed"), timeout=60)
    uid = pdr["metadata"]["uid"]
    for kind, obj in (("service", name), ("secret", f"{name}-admin")):
        (ref,) = cluster.get(kind, obj, "-n", namespace)["metadata"]["ownerReferences"]
        assert ref["uid"] == uid and ref["controller"] is True
