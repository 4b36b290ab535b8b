"""A change of the mounted rollout layout (EP, ADP, node count) is a change of what the engines run: it
must change the group's template hash and be one group update, as an image change is. Before, the hash
left the layout out: the ConfigMap and observedGeneration moved on while the engines kept the old one."""
import json
from pathlib import Path

import pytest
import yaml

from pdrollout.operator import builders
from pdrollout.operator.models import PDRolloutSpec

ROOT = Path(__file__).resolve().parents[2]
TWO_NODE = yaml.safe_load((ROOT / "examples/pdrollout-2node.yaml").read_text())
# One change at a time, each valid after the ones before it (EP16/ADP8 on 2×8 -> EP8 -> ADP4 -> one node).
STEPS = [{"expertParallel": 8}, {"attentionDataParallel": 4}, {"nodes": 1}]


def _specs() -> list[PDRolloutSpec]:
    topology, out = dict(TWO_NODE["spec"]["topology"]), [PDRolloutSpec.model_validate(TWO_NODE["spec"])]
    for step in STEPS:
        topology.update(step)
        out.append(PDRolloutSpec.model_validate({**TWO_NODE["spec"], "topology": dict(topology)}))
    return out


def test_each_layout_change_changes_the_template_hash():
    specs = _specs()
    hashes = [builders.template_hash("r", "ns", s) for s in specs]
    assert len(set(hashes)) == len(hashes), hashes
    for before, after in zip(specs, specs[1:]):
        # ...and the layout is what moved: the engines read it from the ConfigMap, not the pod template
        layout = [json.loads(builders.configmap("r", "ns", s)["data"][builders.ROLLOUT_INFO_KEY])
                  for s in (before, after)]
        assert layout[0] != layout[1]


def _pods(cluster, ns, name) -> list[dict]:
    return [p for p in cluster.get("pods", "-n", ns, "-l", f"{builders.LABEL_ROLLOUT}={name}")["items"]
            if not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") == "Running"]


@pytest.mark.cluster
def test_ep_adp_and_node_count_changes_are_one_group_update_each(cluster, operator, namespace, wait):
    """On the real API server (fake nodes): EP 16->8, then ADP 8->4, then nodes 2->1. Each is one
    GroupUpdate (counted once, a Normal event), the whole group on the new hash, never a GroupRestart;
    the ConfigMap's layout is the one the new pods were made for."""
    name = TWO_NODE["metadata"]["name"]
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(TWO_NODE))
    specs = _specs()

    def group_on(spec: PDRolloutSpec):
        want = builders.template_hash(name, namespace, spec)
        pods = _pods(cluster, namespace, name)
        on = [p for p in pods if p["metadata"]["annotations"].get(builders.TEMPLATE_HASH) == want]
        return pods if len(on) == len(pods) == spec.topology.nodes else None

    before = wait("the group on the first layout", lambda: group_on(specs[0]), timeout=90)
    topology = dict(TWO_NODE["spec"]["topology"])
    for n, (step, spec) in enumerate(zip(STEPS, specs[1:]), start=1):
        uids = {p["metadata"]["uid"] for p in before}
        wait("the group recorded", lambda: set((cluster.get("pdrollout", name, "-n", namespace)["status"]
                                                .get("groupPods") or {}).values()) == uids, timeout=30)
        topology.update(step)
        cluster.kubectl("patch", "pdrollout", name, "-n", namespace, "--type=merge",
                        "-p", json.dumps({"spec": {"topology": topology}}))
        after = wait(f"the group on layout {step}", lambda: group_on(spec), timeout=120)
        assert not uids & {p["metadata"]["uid"] for p in after}, f"{step}: a pod kept the old layout"
        def finished(n=n):
            r = cluster.get("pdrollout", name, "-n", namespace)
            return r if "updatingTo" not in r["status"] and r["status"].get("groupUpdates") == n else None

        pdr = wait(f"update {n} to finish", finished, timeout=60)
        assert not pdr["status"].get("groupRestarts"), f"{step}: counted as a fault: {pdr['status']}"
        cm = cluster.get("configmap", builders.configmap_name(name), "-n", namespace)
        info = json.loads(cm["data"][builders.ROLLOUT_INFO_KEY])
        assert (info["nodes"], info["expertParallel"], info["attentionDataParallel"]) == \
            (spec.topology.nodes, spec.topology.expert_parallel, spec.topology.attention_data_parallel)
        before = after
    events = cluster.get("events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")["items"]
    reasons = [(e["type"], e["reason"]) for e in events]
    assert ("Normal", "GroupUpdate") in reasons and ("Warning", "GroupRestart") not in reasons, reasons
