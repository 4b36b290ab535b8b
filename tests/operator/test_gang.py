"""Gang scheduling against the real API server with a real gang scheduler: kube-scheduler (this
cluster's version) with the Coscheduling plugin of kubernetes-sigs/scheduler-plugins, built by
e2e/cluster/build.sh with the control plane, and its PodGroup CRD. A two-node group that can be placed only in part
never binds a pod (no GPUs held), while the same group without `gang` binds the pod that fits; once the
group fits, both pods bind."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pod_launch import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
SCHEDULER = "pdrollout-gang"


@pytest.fixture(scope="module")
def gang_scheduler(cluster, tmp_path_factory):
    cluster.kubectl("apply", "--server-side", "-f", cluster.tools["podgroup-crd"])
    cluster.kubectl("wait", "--for=condition=Established", "crd/podgroups.scheduling.x-k8s.io", "--timeout=60s")
    d = tmp_path_factory.mktemp("gang")
    (d / "config.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
        "leaderElection": {"leaderElect": False},
        "clientConnection": {"kubeconfig": str(cluster.kubeconfig)},
        "profiles": [{"schedulerName": SCHEDULER,
                      "plugins": {"multiPoint": {"enabled": [{"name": "Coscheduling"}]},
                                  "queueSort": {"enabled": [{"name": "Coscheduling"}], "disabled": [{"name": "*"}]}},
                      "pluginConfig": [{"name": "Coscheduling", "args": {"permitWaitingTimeSeconds": 10}}]}]}))
    log = open(d / "scheduler.log", "wb")
    proc = subprocess.Popen([cluster.tools["gang-scheduler"], f"--config={d / 'config.yaml'}",
                             "--bind-address=127.0.0.1", f"--secure-port={free_port()}", "-v=2"],
                            stdout=log, stderr=subprocess.STDOUT)
    yield {"log": d / "scheduler.log", "proc": proc}
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    print(f"\n[gang scheduler] log tail:\n{(d / 'scheduler.log').read_text(errors='replace')[-3000:]}",
          file=sys.stderr)


def rollout(name: str, hosts: list[str], gang: bool) -> dict:
    doc = yaml.safe_load((ROOT / "examples/pdrollout-2node.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["podTemplate"] = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": hosts}]}]}}}}
    if gang:
        doc["spec"]["gang"] = {"schedulerName": SCHEDULER, "scheduleTimeoutSeconds": 30}
    return doc


def test_half_placeable_group_never_holds_gpus(cluster, operator, gang_scheduler, namespace, wait):
    ns = namespace
    # Both groups may use one GPU node only; exclusive placement puts their two pods on two nodes.
    for doc in (rollout("plain", ["gpu-2"], gang=False), rollout("gang", ["gpu-0"], gang=True)):
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))

    def pods(name):
        return cluster.get("pods", "-n", ns, "-l", f"pdrollout.io/rollout={name}")["items"]

    # Without gang scheduling the pod that fits binds and holds gpu-2's GPUs while its peer is Pending.
    wait("plain: one pod bound", lambda: sorted(bool(p["spec"].get("nodeName")) for p in pods("plain"))
         == [False, True], timeout=60)
    pg = wait("the PodGroup", lambda: (r := cluster.kubectl("get", "podgroup", "gang", "-n", ns, "-o", "json",
                                                            check=False)).returncode == 0 and json.loads(r.stdout),
              timeout=60)
    assert pg["spec"]["minMember"] == 2 and pg["metadata"]["ownerReferences"][0]["kind"] == "PDRollout"
    gp = wait("both gang pods created", lambda: len(p := pods("gang")) == 2 and p, timeout=60)
    assert all(p["spec"]["schedulerName"] == SCHEDULER and
               p["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "gang" for p in gp)

    # With it, neither binds: past the plugin's permit wait, many scheduling attempts, nothing held.
    deadline = time.monotonic() + 25
    while time.monotonic() < deadline:
        assert not [p["metadata"]["name"] for p in pods("gang") if p["spec"].get("nodeName")], \
            "a pod of a half-placeable gang was bound"
        time.sleep(1)
    assert all(p["status"].get("phase") == "Pending" for p in pods("gang"))
    events = cluster.get("events", "-n", ns, "--field-selector", "reason=FailedScheduling")["items"]
    assert any(e["involvedObject"]["name"].startswith("gang-") for e in events), events

    # The group fits once a second node is allowed: both pods bind, together.
    cluster.kubectl("patch", "pdrollout", "gang", "-n", ns, "--type=json", "-p", json.dumps([{
        "op": "replace", "path": "/spec/podTemplate/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution"
                                 "/nodeSelectorTerms/0/matchExpressions/0/values", "value": ["gpu-0", "gpu-1"]}]))
    bound = wait("both gang pods bound", lambda: len(p := [x for x in pods("gang")
                                                           if not x["metadata"].get("deletionTimestamp")]) == 2
                 and all(x["spec"].get("nodeName") for x in p) and p, timeout=90)
    assert sorted(p["spec"]["nodeName"] for p in bound) == ["gpu-0", "gpu-1"]
