"""The operator against the real control plane (etcd, kube-apiserver, controller-manager, scheduler, fake nodes)
built from source: helm install, apply, exact objects and env, status, validation, group restart,
garbage collection. Engine-facing paths are in test_live_engine.py."""
import base64
import json
import signal
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from chart_install import admin_token
from converged import assert_converged

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def when(get, pred):
    """For wait(): the value of get() once pred(value) holds, else None."""
    return lambda: v if pred(v := get()) else None


def rollout(cluster, ns, name) -> dict:
    return cluster.get("pdrollout", name, "-n", ns)


def cond(obj, type_) -> dict:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_), {})


def test_helm_install_and_example(cluster, installed, operator, namespace, wait):
    # The chart's operator Deployment runs (as a fake node's pod) and the CRD serves.
    pods = cluster.get("pods", "-n", installed["namespace"])["items"]
    assert pods and all(p["status"]["phase"] == "Running" for p in pods)

    cluster.kubectl("apply", "-n", namespace, "-f", str(ROOT / "examples/pdrollout.yaml"))
    name = "qwen3-30b"
    sts = wait("the StatefulSet", lambda: cluster.kubectl("get", "statefulset", name, "-n", namespace,
                                                          "-o", "json", check=False).stdout)
    assert_converged(cluster, namespace, name)

    env = {e["name"]: e.get("value") for e in
           json.loads(sts)["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PDROLLOUT_ROLLOUT_INFO"] == "/etc/pdrollout/rollout.json"
    info = json.loads(cluster.get("configmap", f"{name}-engine", "-n", namespace)["data"]["rollout.json"])
    assert (info["nodes"], info["gpusPerNode"], info["worldSize"]) == (1, 8, 8)
    assert (info["expertParallel"], info["attentionDataParallel"], info["attentionTP"], info["expertTP"]) == \
        (8, 2, 4, 1)
    assert info["masterAddr"] == f"{name}-0.{name}.{namespace}.svc.cluster.local"
    assert (info["device"], info["expertBackend"]) == ("cuda", "deep_ep")
    assert env["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "32" and env["PDROLLOUT_QP_RANGE_D"] == "0:16" \
        and env["PDROLLOUT_QP_RANGE_P"] == "16:32" and env["NCCL_SOCKET_IFNAME"] == "eth0" \
        and env["NVSHMEM_IB_ENABLE_IBGDA"] == "0"

    # The pod runs on a fake GPU node with a loopback pod IP; its index label feeds the node rank.
    pod = wait("pod Running", when(lambda: cluster.get("pod", f"{name}-0", "-n", namespace),
                                   lambda p: p.get("status", {}).get("phase") == "Running"), timeout=60)
    assert pod["spec"]["nodeName"].startswith("gpu-")
    assert pod["status"]["podIP"].startswith("127.1.")
    assert pod["metadata"]["labels"]["apps.kubernetes.io/pod-index"] == "0"

    # Security: no API token in the engine pod; the rollout's NetworkPolicy selects exactly its pods
    # (the API server stores it; enforcing it needs a CNI, which this cluster has none of).
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert not [v for v in pod["spec"]["volumes"] if v["name"].startswith("kube-api-access")]
    np = cluster.get("networkpolicy", name, "-n", namespace)
    selected = cluster.get("pods", "-n", namespace, "-l", ",".join(
        f"{k}={v}" for k, v in np["spec"]["podSelector"]["matchLabels"].items()))["items"]
    assert [p["metadata"]["name"] for p in selected] == [f"{name}-0"]
    operator_from = np["spec"]["ingress"][1]["from"][0]
    system_pods = cluster.get("pods", "-n", operator_from["namespaceSelector"]["matchLabels"][
        "kubernetes.io/metadata.name"], "-l", "pdrollout.io/component=operator")["items"]
    assert len(system_pods) == 1, "the policy's operator selector must match the chart's operator pod"
    token = base64.b64decode(cluster.get("secret", f"{name}-admin", "-n", namespace)["data"]["token"]).decode()
    assert token == admin_token(cluster, namespace, name)

    # No engine answers on the pod IP: the pods are ready, the group is Degraded (unreachable).
    pdr = wait("Degraded status", when(lambda: rollout(cluster, namespace, name),
                                       lambda r: r.get("status", {}).get("phase") == "Degraded"), timeout=30)
    assert pdr["status"]["readyNodes"] == 1
    assert pdr["status"]["observedGeneration"] == pdr["metadata"]["generation"]
    assert (cond(pdr, "Ready")["status"], cond(pdr, "Ready")["reason"]) == ("False", "EngineUnreachable")
    assert cond(pdr, "Degraded")["status"] == "True" and cond(pdr, "Progressing")["status"] == "False"
    assert cond(pdr, "Stalled")["status"] == "False"
    table = cluster.kubectl("get", "pdr", name, "-n", namespace).stdout.split("\n")[0].split()
    assert table == ["NAME", "PHASE", "NODES", "READY", "READY-GROUPS", "MAKESPAN(S)", "RECENT-TTFT-P99(S)", "AGE"]
    events = cluster.get("events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")["items"]
    assert any(e["reason"] == "Degraded" and e["type"] == "Warning" for e in events), events


def test_operator_runs_with_least_privilege(cluster, installed):
    sa = f"system:serviceaccount:{installed['namespace']}:{installed['serviceaccount']}"

    def can(verb, resource, ns="default"):
        r = cluster.kubectl("auth", "can-i", verb, resource, "-n", ns, "--as", sa, check=False)
        return r.stdout.strip() == "yes"

    assert can("patch", "pdrollouts.pdrollout.io/status") and can("create", "statefulsets.apps")
    assert can("delete", "pods") and can("list", "pods")
    assert can("create", "secrets") and can("patch", "networkpolicies.networking.k8s.io")
    assert not can("get", "secrets") and not can("delete", "statefulsets.apps")
    assert not can("list", "nodes") and not can("update", "configmaps") and not can("create", "pods")
    # spec.router: what the operator creates for it, and no way to grant more than it holds
    assert can("create", "roles.rbac.authorization.k8s.io") and can("delete", "deployments.apps")
    assert not can("escalate", "roles.rbac.authorization.k8s.io") and not can("bind", "roles.rbac.authorization.k8s.io")
    # spec.replicas: a fleet creates and deletes its groups (PDRollouts), nothing else more
    assert can("create", "pdrollouts.pdrollout.io") and can("delete", "pdrollouts.pdrollout.io")
    assert not can("update", "pdrollouts.pdrollout.io") and not can("deletecollection", "pdrollouts.pdrollout.io")


def test_invalid_resources_rejected(cluster, installed, namespace):
    docs = list(yaml.safe_load_all((Path(__file__).parent / "invalid-pdrollouts.yaml").read_text()))
    assert len(docs) >= 5
    for doc in docs:
        expected = doc["metadata"]["annotations"]["test.pdrollout.io/expect-error"]
        r = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False)
        assert r.returncode != 0, f"{doc['metadata']['name']} was accepted"
        assert expected in r.stderr, f"{doc['metadata']['name']}: {r.stderr}"
    # Unknown fields are refused too, not silently dropped.
    doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())
    doc["spec"]["topology"]["gpus"] = 8
    r = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert r.returncode != 0 and 'unknown field "spec.topology.gpus"' in r.stderr, r.stderr
    assert not cluster.get("pdrollouts", "-n", namespace)["items"]


def test_unusable_names_refused_at_admission(cluster, installed, namespace):
    """A name the Service or the StatefulSet's pods cannot carry is refused by the CRD's CEL rule (the
    real API server evaluates it), not accepted to sit in Starting forever."""
    doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())
    for bad, why in (("dotted.name", "must be a DNS-1035 label"), ("1starts-with-digit", "must be a DNS-1035 label"),
                     ("a" * 53, "must be at most 52 characters")):
        doc["metadata"]["name"] = bad
        r = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False)
        assert r.returncode != 0 and why in r.stderr, f"{bad}: {r.stderr}"
    # a fleet's groups are '<name>-<index>': 50 characters and group index 10 is one too many
    doc["metadata"]["name"], doc["spec"]["replicas"] = "f" * 50, 11
    r = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert r.returncode != 0 and "spec.replicas: the groups' names" in r.stderr, r.stderr
    doc["spec"]["replicas"] = 10
    assert cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-",
                           input=yaml.safe_dump(doc), check=False).returncode == 0
    assert not cluster.get("pdrollouts", "-n", namespace)["items"]


def test_longest_allowed_name_runs(cluster, operator, namespace, wait):
    """The limit is not too strict either: a 52-character name gets its Services and a Running pod (whose
    controller-revision-hash label is `<name>-<hash>`, the longest derived name)."""
    doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())
    doc["metadata"]["name"] = name = "l" * 52
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    pod = wait("pod Running", when(lambda: cluster.kubectl("get", "pod", f"{name}-0", "-n", namespace, "-o", "json",
                                                           check=False),
                                   lambda r: r.returncode == 0 and json.loads(r.stdout)["status"].get("phase")
                                   == "Running"), timeout=60)
    labels = json.loads(pod.stdout)["metadata"]["labels"]
    assert labels["controller-revision-hash"].startswith(name + "-")
    cluster.get("service", f"{name}-api", "-n", namespace)


def test_spec_the_api_server_refuses_sets_invalid_spec(cluster, operator, namespace, wait):
    """Defence behind the CRD: a spec the CRD accepts but whose built object the API server refuses (an
    RDMA resource name that is no resource name) ends in phase Failed with an InvalidSpec condition carrying
    the API server's message, not in Starting; fixing the spec clears it and the rollout proceeds."""
    doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())
    doc["metadata"]["name"] = name = "bad-rdma"
    doc["spec"].setdefault("resources", {})["rdmaResource"] = "not a resource"
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    pdr = wait("InvalidSpec", when(lambda: rollout(cluster, namespace, name),
                                   lambda r: cond(r, "InvalidSpec").get("status") == "True"), timeout=60)
    c = cond(pdr, "InvalidSpec")
    assert c["reason"] == "ObjectRefused" and f"StatefulSet {name} refused by the API server" in c["message"]
    assert "not a resource" in c["message"] and "Invalid value" in c["message"], c["message"]
    assert pdr["status"]["phase"] == "Failed"
    time.sleep(3)   # the timer (1 s here) must not overwrite it with Starting
    pdr = rollout(cluster, namespace, name)
    assert pdr["status"]["phase"] == "Failed" and cond(pdr, "InvalidSpec")["status"] == "True"
    events = cluster.get("events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")["items"]
    assert any(e["reason"] == "InvalidSpec" and e["type"] == "Warning" for e in events), events

    cluster.kubectl("patch", "pdrollout", name, "-n", namespace, "--type=merge",
                    "-p", json.dumps({"spec": {"resources": {"rdmaResource": "rdma/ib"}}}))
    wait("the StatefulSet after the fix",
         lambda: cluster.kubectl("get", "statefulset", name, "-n", namespace, check=False).returncode == 0,
         timeout=60)
    pdr = wait("InvalidSpec cleared", when(lambda: rollout(cluster, namespace, name),
                                           lambda r: not cond(r, "InvalidSpec")
                                           and r["status"].get("phase") != "Failed"), timeout=60)


def test_pod_template_overrides_reach_the_pods(cluster, operator, namespace, wait):
    """podTemplate, validated by the real API server as part of the StatefulSet: the pod carries the extra
    env, volume, mount, annotation, pull secret, toleration and priority class, and the scheduler obeys the
    nodeSelector (gpu-1 of the fake nodes)."""
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": "rollout-high"},
        "value": 1000}))
    doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())
    doc["metadata"]["name"] = name = "placed"
    doc["spec"]["podTemplate"] = {
        "annotations": {"team": "rl"}, "nodeSelector": {"kubernetes.io/hostname": "gpu-1"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}],
        "imagePullSecrets": [{"name": "regcred"}], "priorityClassName": "rollout-high",
        "env": [{"name": "HF_HOME", "value": "/cache"}],
        "volumes": [{"name": "cache", "emptyDir": {"sizeLimit": "1Gi"}}],
        "volumeMounts": [{"name": "cache", "mountPath": "/cache"}]}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    pod = wait("pod Running", when(lambda: cluster.kubectl("get", "pod", f"{name}-0", "-n", namespace, "-o", "json",
                                                           check=False),
                                   lambda r: r.returncode == 0 and json.loads(r.stdout)["status"].get("phase")
                                   == "Running"), timeout=60)
    pod = json.loads(pod.stdout)
    assert pod["spec"]["nodeName"] == "gpu-1"
    assert pod["metadata"]["annotations"]["team"] == "rl" and pod["spec"]["priority"] == 1000
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert {"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"} in \
        pod["spec"]["tolerations"]
    c = pod["spec"]["containers"][0]
    assert {"name": "HF_HOME", "value": "/cache"} in c["env"]
    assert {"name": "cache", "mountPath": "/cache"} in c["volumeMounts"]
    assert any(v["name"] == "cache" and v["emptyDir"] == {"sizeLimit": "1Gi"} for v in pod["spec"]["volumes"])
    assert_converged(cluster, namespace, name)


def test_forbidden_is_retried_with_backoff_until_rbac_is_fixed(cluster, installed, operator, namespace, wait):
    """A 403 (the operator's RBAC lacks a grant) is retried with a doubling delay, not given up: once the
    grant is back, the same rollout converges without any change to it."""
    role_name = installed["serviceaccount"]
    saved = cluster.get("clusterrole", role_name)
    cut = {**saved, "rules": [r for r in saved["rules"] if "networkpolicies" not in r["resources"]]}
    for k in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
        cut["metadata"].pop(k, None)
    assert len(cut["rules"]) == len(saved["rules"]) - 1
    cluster.kubectl("replace", "-f", "-", input=json.dumps(cut))
    try:
        doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())
        doc["metadata"]["name"] = name = "forbidden"
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))

        def progress():
            ann = rollout(cluster, namespace, name)["metadata"].get("annotations", {})
            return json.loads(ann.get("pdrollout.io/reconcile", "{}"))

        p = wait("two retries after 403", when(progress, lambda p: p.get("retries", 0) >= 2), timeout=60)
        assert "HTTP 403" in p["message"] and "RBAC lacks this grant" in p["message"], p
        assert "in 10 s" in p["message"] and not p.get("failure"), p   # 5 s, then doubled
        assert cluster.kubectl("get", "statefulset", name, "-n", namespace, check=False).returncode != 0
    finally:
        restored = {**saved, "metadata": {k: v for k, v in saved["metadata"].items()
                                          if k not in ("resourceVersion", "uid", "creationTimestamp",
                                                       "managedFields")}}
        cluster.kubectl("replace", "-f", "-", input=json.dumps(restored))
    wait("the StatefulSet once the grant is back",
         lambda: cluster.kubectl("get", "statefulset", name, "-n", namespace, check=False).returncode == 0,
         timeout=60)
    assert_converged(cluster, namespace, name)


def test_template_change_is_one_group_update_not_a_restart(cluster, operator, namespace, wait):
    """A change to the pod template (here the image) recreates both pods of a two-node group once, together,
    on the new template: a Normal GroupUpdate event, Progressing=True (GroupUpdating) and phase Updating
    while it lasts, and no GroupRestart warning (before, the StatefulSet's pod-by-pod rollout looked like
    a pod recreated without its group). Every status the operator wrote is seen through a watch."""
    doc = yaml.safe_load((ROOT / "examples/pdrollout-2node.yaml").read_text())
    name = doc["metadata"]["name"]
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))

    def pods():
        live = [p for p in cluster.get("pods", "-n", namespace, "-l", f"pdrollout.io/rollout={name}")["items"]
                if not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") == "Running"]
        return live if len(live) == 2 else None

    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in wait("both pods Running", pods, timeout=60)}
    wait("the group recorded", lambda: rollout(cluster, namespace, name)["status"].get("groupPods") == before,
         timeout=30)
    watch = subprocess.Popen([cluster.tools["kubectl"], "get", "pdrollout", name, "-n", namespace, "--watch",
                              "-o", "json"], env=cluster.env, stdout=subprocess.PIPE, text=True)
    try:
        new_image = doc["spec"]["image"] + "-next"
        cluster.kubectl("patch", "pdrollout", name, "-n", namespace, "--type=merge",
                        "-p", json.dumps({"spec": {"image": new_image}}))

        def updated():
            p = pods()
            return p if p and all(x["metadata"]["uid"] != before[x["metadata"]["name"]]
                                  and x["spec"]["containers"][0]["image"] == new_image for x in p) else None

        wait("both pods on the new image", updated, timeout=90)
        pdr = wait("the update to finish", when(lambda: rollout(cluster, namespace, name),
                                                lambda r: "updatingTo" not in r["status"]
                                                and r["status"].get("phase") == "Degraded"), timeout=60)
    finally:
        watch.terminate()
        out, _ = watch.communicate(timeout=30)
    seen = [json.loads(doc) for doc in _json_stream(out)]
    progressing = [cond(o, "Progressing") for o in seen]
    assert any(c.get("status") == "True" and c.get("reason") == "GroupUpdating" for c in progressing), progressing
    assert "Updating" in [o["status"].get("phase") for o in seen]
    assert not [o for o in seen if o["status"].get("phase") == "Restarting"]
    assert pdr["status"]["groupUpdates"] == 1 and not pdr["status"].get("groupRestarts")
    events = cluster.get("events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")["items"]
    reasons = [(e["type"], e["reason"]) for e in events]
    assert ("Normal", "GroupUpdate") in reasons and not [r for r in reasons if r[1] == "GroupRestart"], reasons
    assert_converged(cluster, namespace, name)


def _json_stream(text: str) -> list[str]:
    """The objects of `kubectl get -w -o json` (concatenated, pretty-printed JSON documents)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            break
        obj, i = dec.raw_decode(text, i)
        out.append(json.dumps(obj))
    return out


def test_two_replicas_one_leader_and_failover(cluster, installed, operator, namespace, tmp_path, wait):
    """Two operator processes with leader election (the chart's Lease RBAC, as its ServiceAccount): exactly
    one reconciles; when it is killed (no release), the other takes over within the lease and reconciles
    what comes next."""
    Operator = type(operator)   # conftest's process wrapper
    lease_s = 6.0
    operator.kill(signal.SIGTERM)
    replicas = {}
    try:
        for ident in ("op-a", "op-b"):
            replicas[ident] = Operator(env={**operator.env, "POD_ID": ident, "PDROLLOUT_OPERATOR_LEADER_ELECT": "true",
                                            "PDROLLOUT_OPERATOR_LEASE_S": str(lease_s),
                                            # each replica serves its metrics on a port of its own
                                            "PDROLLOUT_OPERATOR_METRICS_ADDRESS": f"127.0.0.1:{_free_port()}"},
                                       log=tmp_path / f"{ident}.log").start()

        def holder():
            r = cluster.kubectl("get", "lease", "pdrollout-operator", "-n", installed["namespace"], "-o", "json",
                                check=False)
            return r.returncode == 0 and json.loads(r.stdout)["spec"].get("holderIdentity")

        leader = wait("a leader", holder, timeout=60)
        standby = next(i for i in replicas if i != leader)
        doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())
        doc["metadata"]["name"] = "led-1"
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
        wait("led-1's StatefulSet", lambda: cluster.kubectl("get", "statefulset", "led-1", "-n", namespace,
                                                            check=False).returncode == 0, timeout=60)
        time.sleep(2 * lease_s / 7.5 + 1)   # a few renewals and standby attempts
        assert "applied StatefulSet led-1" in replicas[leader].log.read_text()
        standby_log = replicas[standby].log.read_text()
        assert "standby: Lease" in standby_log and "applied " not in standby_log, standby_log[-2000:]
        assert holder() == leader

        replicas[leader].kill(signal.SIGKILL)   # no release: the standby must wait the lease out
        t0 = time.monotonic()
        doc["metadata"]["name"] = "led-2"
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
        wait("led-2's StatefulSet from the new leader", lambda: cluster.kubectl(
            "get", "statefulset", "led-2", "-n", namespace, check=False).returncode == 0, timeout=60)
        took = time.monotonic() - t0
        assert holder() == standby
        # The lease, one standby retry, kopf's start and one reconcile.
        assert lease_s <= took + 1 and took < lease_s + 10, f"failover took {took:.1f}s for a {lease_s}s lease"
        assert "applied StatefulSet led-2" in replicas[standby].log.read_text()
        assert "applied StatefulSet led-2" not in replicas[leader].log.read_text()
        lease = cluster.get("lease", "pdrollout-operator", "-n", installed["namespace"])
        assert lease["spec"]["leaseTransitions"] >= 1
    finally:
        for r in replicas.values():
            r.kill(signal.SIGKILL)
        operator.start()


def test_gang_without_its_crd_is_invalid_spec(cluster, operator, namespace, wait):
    """spec.gang on a cluster without scheduler-plugins' PodGroup CRD: InvalidSpec naming what is missing,
    not a rollout stuck in Starting with pods no scheduler will take. kopf runs the status timer beside
    reconcile; here one tick reads status before the refusal lands and writes after it (its conditions
    list replaces the whole list), and InvalidSpec must come back and stay."""
    cluster.kubectl("delete", "crd", "podgroups.scheduling.x-k8s.io", "--ignore-not-found", "--wait=true")
    operator.kill(signal.SIGTERM)
    seen = operator.log.stat().st_size
    try:
        # Six applies of 0.5 s: the refusal lands ~3 s in. The first tick (1 s in) lists pods for 8 s.
        operator.start(ROOT / "tests/slow_operator.py", PDROLLOUT_TEST_APPLY_PAUSE_S="0.5",
                       PDROLLOUT_TEST_LIST_PAUSE_S="8")
        doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())
        doc["metadata"]["name"] = name = "gang-no-crd"
        doc["spec"]["gang"] = {"schedulerName": "nobody"}
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
        invalid = when(lambda: rollout(cluster, namespace, name),
                       lambda r: cond(r, "InvalidSpec").get("status") == "True")
        wait("InvalidSpec", invalid, timeout=60)
        wait("the stale tick's write and the re-assertion", lambda: "re-asserting InvalidSpec" in
             operator.log.read_bytes()[seen:].decode(errors="replace"), timeout=60)
        held_since = time.monotonic()
        while time.monotonic() - held_since < 4:      # four more ticks: it stays
            pdr = invalid()
            assert pdr, f"InvalidSpec lost again: {rollout(cluster, namespace, name).get('status')}"
            time.sleep(0.5)
    finally:
        operator.kill(signal.SIGKILL)
        operator.start()
    assert "PodGroup is not served by this cluster" in cond(pdr, "InvalidSpec")["message"]
    assert pdr["status"]["phase"] == "Failed"
    assert cluster.kubectl("get", "statefulset", name, "-n", namespace, check=False).returncode != 0


def test_failed_pod_recreates_whole_group_then_gc(cluster, operator, namespace, wait):
    doc = yaml.safe_load((ROOT / "examples/pdrollout-2node.yaml").read_text())
    name = doc["metadata"]["name"]
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))

    def running_pods():
        pods = cluster.get("pods", "-n", namespace, "-l", f"pdrollout.io/rollout={name}")["items"]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")
                and p["status"].get("phase") == "Running"]
        return live if len(live) == 2 else None

    def recorded():
        """The operator knows this incarnation (it compares pod UIDs against it)."""
        pods = running_pods()
        uids = pods and {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
        return uids if uids and rollout(cluster, namespace, name)["status"].get("groupPods") == uids else None

    pods = wait("both pods Running", running_pods, timeout=60)
    nodes = {p["spec"]["nodeName"] for p in pods}
    assert len(nodes) == 2, f"exclusive placement violated: {nodes}"
    before = wait("the operator to record the group", recorded, timeout=30)

    # Rank 1 fails; rank 0 is fine. Both must be replaced (all-or-nothing).
    cluster.kubectl("patch", "pod", f"{name}-1", "-n", namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": {"phase": "Failed", "reason": "InjectedByTest"}}))

    def replaced():
        pods = running_pods()
        return pods if pods and all(p["metadata"]["uid"] != before[p["metadata"]["name"]] for p in pods) else None

    wait("both pods recreated", replaced, timeout=60)
    pdr = rollout(cluster, namespace, name)
    assert pdr["status"]["groupRestarts"] == 1 and pdr["status"]["restartStreak"] == 1
    events = cluster.get("events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")["items"]
    # Seen either as the failure itself or, if the StatefulSet controller replaced the pod first, by UID.
    why = (f"pod {name}-1 failed (InjectedByTest)", f"pod {name}-1 was recreated without its group")
    assert any(e["reason"] == "GroupRestart" and any(w in e["message"] for w in why)
               for e in events), [e["message"] for e in events]

    # A second failure before the group ever ran healthy waits out the backoff, and says so.
    before = wait("the operator to record the new group", recorded, timeout=30)
    cluster.kubectl("patch", "pod", f"{name}-0", "-n", namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": {"phase": "Failed", "reason": "AgainByTest"}}))
    pdr = wait("Restarting in backoff", when(lambda: rollout(cluster, namespace, name),
                                             lambda r: r["status"].get("phase") == "Restarting"), timeout=20)
    assert "backoff" in cond(pdr, "Degraded")["message"] and cond(pdr, "Degraded")["reason"] == "GroupRestarting"
    wait("second group restart", lambda: rollout(cluster, namespace, name)["status"].get("groupRestarts") == 2,
         timeout=40)
    wait("both pods recreated again", replaced, timeout=60)

    # Delete: the controller-manager's garbage collector removes everything the rollout owned (the
    # operator cannot: its RBAC has no delete on StatefulSets, Services or ConfigMaps).
    cluster.kubectl("delete", "pdrollout", name, "-n", namespace, "--timeout=60s")

    def gone():
        left = [f"{k}/{n}" for k, n in (("statefulset", name), ("service", name), ("service", f"{name}-api"),
                                         ("configmap", f"{name}-engine"))
                if cluster.kubectl("get", k, n, "-n", namespace, check=False).returncode == 0]
        left += [p["metadata"]["name"] for p in cluster.get("pods", "-n", namespace)["items"]]
        return not left or None

    wait("garbage collection", gone, timeout=90)


def test_operator_killed_mid_reconcile_converges(cluster, operator, namespace, wait):
    operator.kill(signal.SIGTERM)
    try:
        # A slow API server: 4 s before each apply of one reconcile, so the kill lands in the middle.
        operator.start(ROOT / "tests/slow_operator.py", PDROLLOUT_TEST_APPLY_PAUSE_S="4")
        doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())
        doc["metadata"]["name"] = name = "crashy"
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))

        def exists(kind, n):
            return cluster.kubectl("get", kind, n, "-n", namespace, check=False).returncode == 0

        wait("the ConfigMap (first apply)", lambda: exists("configmap", f"{name}-engine"), timeout=60,
             interval=0.1)
        operator.kill(signal.SIGKILL)
        assert not exists("statefulset", name), "the kill was meant to land before the StatefulSet apply"
    finally:
        operator.kill(signal.SIGKILL)
        operator.start()
    wait("the StatefulSet after restart", lambda: exists("statefulset", name), timeout=60)
    wait("status after restart", lambda: rollout(cluster, namespace, name).get("status", {}).get("readyNodes") == 1,
         timeout=60)
    assert_converged(cluster, namespace, name)
    pdr = rollout(cluster, namespace, name)
    assert pdr["status"]["observedGeneration"] == pdr["metadata"]["generation"]
    assert not pdr["metadata"].get("finalizers"), pdr["metadata"]   # observer.py needs none


def test_api_server_restart_watch_recovers(cluster, operator, namespace, wait):
    r = subprocess.run(["bash", str(ROOT / "e2e/cluster/restart.sh"), str(cluster.dir), "kube-apiserver", "2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    wait("API server back", lambda: cluster.kubectl("get", "--raw", "/readyz", check=False).returncode == 0,
         timeout=120)
    doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())
    doc["metadata"]["name"] = name = "after-restart"
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    wait("the operator to act after its watch broke",
         lambda: cluster.kubectl("get", "statefulset", name, "-n", namespace, check=False).returncode == 0,
         timeout=90)
    assert operator.proc.poll() is None, f"operator died:\n{operator.logs()}"


def test_an_old_operators_finalizer_is_removed(cluster, operator, namespace, wait):
    """A rollout that an operator from before observer.py finalized (a kopf timer's finalizer) loses the
    finalizer once this operator handles it, so deleting it later is not held."""
    doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())
    doc["metadata"]["name"] = name = "old-finalizer"
    doc["metadata"]["finalizers"] = ["pdrollout.io/operator"]
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    wait("the finalizer removed", lambda: not rollout(cluster, namespace, name)["metadata"].get("finalizers"),
         timeout=60)
    cluster.kubectl("delete", "pdrollout", name, "-n", namespace, "--wait=true", "--timeout=20s", timeout=40)


def test_delete_while_observe_waits_on_engine(cluster, operator, namespace, port, wait):
    """A deletion that lands while the observer is inside an engine request is not held by it: the rollout
    carries no finalizer (a kopf timer would put one), so it goes at once, and the request's late status
    write goes nowhere. The engine here is a real HTTP server on the rank-0 pod's IP whose /health answers
    after 2 s, so observe is almost always mid-request."""
    doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())
    doc["metadata"]["name"] = name = "slow-engine"
    doc["spec"]["port"] = port
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    ip = wait("pod IP", lambda: cluster.kubectl("get", "pod", f"{name}-0", "-n", namespace, "-o",
                                                "jsonpath={.status.podIP}", check=False).stdout, timeout=60)
    in_health = threading.Event()

    class SlowEngine(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                in_health.set()
                time.sleep(2.0)
                in_health.clear()
                body = b'{"status": "ok"}'
                self.send_response(200)
            else:
                body = b"not here"
                self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer((ip, port), SlowEngine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        wait("Running", lambda: rollout(cluster, namespace, name).get("status", {}).get("phase") == "Running",
             timeout=60)
        assert not rollout(cluster, namespace, name)["metadata"].get("finalizers")
        wait("observe out of /health", lambda: not in_health.is_set(), timeout=10, interval=0.05)
        wait("observe inside /health again", in_health.is_set, timeout=10, interval=0.05)
        t0 = time.monotonic()
        r = cluster.kubectl("delete", "pdrollout", name, "-n", namespace, "--wait=true", "--timeout=50s",
                            check=False, timeout=70)
        took = time.monotonic() - t0
        assert r.returncode == 0, f"deletion did not finish: {r.stderr}{r.stdout}\n{operator.logs()[-3000:]}"
        # nothing waits on the request in flight (2 s); a finalizer with kopf's default re-check took ~60 s
        assert took < 5, f"deletion took {took:.1f}s while observe was mid-request"
    finally:
        server.shutdown()
        server.server_close()
