"""spec.router: the sglang-router Deployment, its discovery RBAC and the client Service in front of it.
Pure builders first, then the operator against the fake-node cluster (the chart's own RBAC)."""
import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from pdrollout.operator import builders, router
from pdrollout.operator.models import PDRolloutSpec
from converged import assert_converged

ROOT = Path(__file__).resolve().parents[2]


def cpu_doc(**router_fields) -> dict:
    doc = yaml.safe_load((ROOT / "examples/pdrollout-cpu.yaml").read_text())
    doc["spec"]["router"] = router_fields
    return doc


def flag(args: list[str], name: str) -> list[str]:
    """The values after `name` up to the next flag (argparse's nargs='+')."""
    i = args.index(name) + 1
    out = []
    while i < len(args) and not args[i].startswith("--"):
        out.append(args[i])
        i += 1
    return out


def test_router_discovers_the_api_pods_of_its_own_rollout():
    spec = PDRolloutSpec.model_validate(cpu_doc(policy="round_robin")["spec"])
    objs = builders.desired_objects("r", "ns", spec, "tok", "ops")
    kinds = [o["kind"] for o in objs]
    assert kinds[kinds.index("StatefulSet") + 1:] == ["ServiceAccount", "Role", "RoleBinding", "Deployment"]
    dep = objs[-1]
    pod = dep["spec"]["template"]
    (ctr,) = pod["spec"]["containers"]
    args = ctr["args"]
    assert args[:2] == ["-m", "sglang_router.launch_router"] and "--service-discovery" in args
    # the selector names node 0 of this rollout, exactly as the client Service did without a router
    selector = dict(kv.split("=", 1) for kv in flag(args, "--selector"))
    assert selector == builders.api_selector("r") == {"pdrollout.io/rollout": "r", "apps.kubernetes.io/pod-index": "0"}
    assert flag(args, "--service-discovery-namespace") == ["ns"]
    assert flag(args, "--service-discovery-port") == flag(args, "--port") == [str(spec.port)]
    assert flag(args, "--policy") == ["round_robin"]
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    assert flag(args, "--prometheus-port") == [str(ports["metrics"])] and ports["http"] == spec.port
    # the router is no member of the group: neither the group's pod list, its headless Service nor its
    # NetworkPolicy's own-pods rule selects it
    assert builders.LABEL_ROLLOUT not in pod["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    # its token may watch pods and nothing else; the binding names its ServiceAccount
    sa, role, binding = objs[-4:-1]
    assert pod["spec"]["serviceAccountName"] == sa["metadata"]["name"] == role["metadata"]["name"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "ns"}]


def test_client_service_points_at_the_router_when_it_is_on():
    on = PDRolloutSpec.model_validate(cpu_doc()["spec"])
    off = PDRolloutSpec.model_validate({**cpu_doc()["spec"], "router": None})
    pod_labels = builders.desired_objects("r", "ns", on, "tok", "ops")[-1]["spec"]["template"]["metadata"]["labels"]
    assert builders.api_service("r", "ns", on)["spec"]["selector"].items() <= pod_labels.items()
    assert builders.api_service("r", "ns", off)["spec"]["selector"] == builders.api_selector("r")
    assert not [o for o in builders.desired_objects("r", "ns", off, "tok", "ops") if o["kind"] == "Deployment"]
    # turned off, every object the router had is what the operator removes
    built = {(o["kind"], o["metadata"]["name"]) for o in router.objects("r", "ns", on.router, 1, {})}
    assert {(o["kind"], o["metadata"]["name"]) for o in router.stale("r", "ns")} == built


@pytest.mark.parametrize("fields, where", [({"policy": "least_loaded"}, "router.policy"),
                                           ({"replicas": 0}, "router.replicas"),
                                           ({"cpu": "lots"}, "router.cpu")])
def test_bad_router_fields_are_refused_naming_the_field(fields, where):
    with pytest.raises(ValidationError) as e:
        PDRolloutSpec.model_validate(cpu_doc(**fields)["spec"])
    assert where in str(e.value), str(e.value)


@pytest.mark.cluster
def test_router_on_policy_change_and_off(cluster, operator, namespace, wait):
    """With the chart's RBAC: the operator creates the router's ServiceAccount, Role, RoleBinding and
    Deployment, the client Service selects the router pod, a policy change reaches the Deployment, and
    unsetting spec.router removes them all and points the Service back at node 0."""
    doc = cpu_doc(policy="cache_aware")
    name = doc["metadata"]["name"]
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))

    def deployment():
        r = cluster.kubectl("get", "deployment", router.name_of(name), "-n", namespace, "-o", "json", check=False)
        return json.loads(r.stdout) if r.returncode == 0 else None

    wait("the router Deployment", deployment, timeout=60)
    assert_converged(cluster, namespace, name)   # every object as built, owned by the rollout
    svc = cluster.get("service", builders.api_service_name(name), "-n", namespace)
    behind = wait("the router pod behind the client Service", lambda: [
        p["metadata"]["name"] for p in cluster.get("pods", "-n", namespace, "-l", ",".join(
            f"{k}={v}" for k, v in svc["spec"]["selector"].items()))["items"]], timeout=60)
    assert all(n.startswith(router.name_of(name) + "-") for n in behind), behind
    sa = f"system:serviceaccount:{namespace}:{router.name_of(name)}"

    def can(verb, resource):
        r = cluster.kubectl("auth", "can-i", verb, resource, "-n", namespace, "--as", sa, check=False)
        return r.stdout.strip() == "yes"

    assert can("watch", "pods") and can("list", "pods")
    assert not can("delete", "pods") and not can("get", "secrets") and not can("list", "deployments.apps")

    cluster.kubectl("patch", "pdrollout", name, "-n", namespace, "--type=merge",
                    "-p", json.dumps({"spec": {"router": {"policy": "power_of_two"}}}))
    wait("the new policy in the Deployment", lambda: (d := deployment()) and flag(
        d["spec"]["template"]["spec"]["containers"][0]["args"], "--policy") == ["power_of_two"], timeout=60)

    cluster.kubectl("patch", "pdrollout", name, "-n", namespace, "--type=json",
                    "-p", json.dumps([{"op": "remove", "path": "/spec/router"}]))
    wait("the router's objects deleted", lambda: not any(
        cluster.kubectl("get", kind, router.name_of(name), "-n", namespace, check=False).returncode == 0
        for kind in ("deployment", "rolebinding", "role", "serviceaccount")), timeout=60)
    svc = cluster.get("service", builders.api_service_name(name), "-n", namespace)
    assert svc["spec"]["selector"] == builders.api_selector(name)
    pdr = cluster.get("pdrollout", name, "-n", namespace)
    assert pdr["status"]["observedGeneration"] == pdr["metadata"]["generation"]
