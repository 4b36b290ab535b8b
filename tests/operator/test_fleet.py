"""spec.replicas: a fleet of engine groups as child PDRollouts. The pure plan and child specs first, then
the operator against the fake-node cluster (the chart's RBAC): children, scale subresource, one-at-a-time roll."""
import json
import subprocess
import threading
from pathlib import Path

import pytest
import yaml

from pdrollout.operator import builders, fleet, router
from pdrollout.operator.models import PDRolloutSpec

ROOT = Path(__file__).resolve().parents[2]


def cpu_doc(replicas: int) -> dict:
    doc = yaml.safe_load((ROOT / "examples/pdrollout-cpu.yaml").read_text())
    doc["spec"]["replicas"] = replicas
    return doc


def test_a_group_is_the_parent_spec_without_fleet_fields_and_its_pods_carry_the_fleet_label():
    doc = cpu_doc(3)
    doc["spec"]["router"] = {"policy": "cache_aware"}
    doc["spec"]["podTemplate"] = {"template": {"metadata": {"labels": {"team": "rl"}}}}
    parent = PDRolloutSpec.model_validate(doc["spec"]).model_dump(by_alias=True, exclude_none=True)
    body = fleet.child_body("f", "ns", 1, parent, "pdrollout.io/v1alpha1", "PDRollout")
    assert body["metadata"]["name"] == "f-1"
    assert body["metadata"]["labels"] == {fleet.LABEL_FLEET: "f", fleet.LABEL_GROUP_INDEX: "1"}
    child = PDRolloutSpec.model_validate(body["spec"])
    assert child.replicas is None and child.router is None and child.max_unavailable_groups is None
    pod = builders.pod_template("f-1", "ns", child)["metadata"]["labels"]
    assert pod[fleet.LABEL_FLEET] == "f" and pod["team"] == "rl" and pod[builders.LABEL_ROLLOUT] == "f-1"
    # the hash follows the group's spec, not the fleet-only fields
    again = fleet.child_body("f", "ns", 1, {**parent, "replicas": 5}, "pdrollout.io/v1alpha1", "PDRollout")
    changed = fleet.child_body("f", "ns", 1, {**parent, "image": "other"}, "pdrollout.io/v1alpha1", "PDRollout")
    assert again["metadata"]["annotations"] == body["metadata"]["annotations"] != changed["metadata"]["annotations"]


def test_plan_rolls_serving_groups_one_at_a_time_and_removes_the_highest_first():
    old, new = "old", "new"
    # all serving: only the lowest outdated group goes down
    p = fleet.plan({0: old, 1: old, 2: old}, {0: True, 1: True, 2: True}, new, 3, 1)
    assert (p.create, p.delete, p.update) == ([], [], [0])
    # group 0 updated but not ready yet: nobody else is taken down
    assert fleet.plan({0: new, 1: old}, {0: False, 1: True}, new, 2, 1).update == []
    # ...until it serves again
    assert fleet.plan({0: new, 1: old}, {0: True, 1: True}, new, 2, 1).update == [1]
    # a group already down costs nothing to update; maxUnavailableGroups 2 takes two serving ones
    assert fleet.plan({0: old, 1: old, 2: old}, {0: False, 1: True, 2: True}, new, 3, 1).update == [0]
    assert fleet.plan({0: old, 1: old, 2: old}, {0: True, 1: True, 2: True}, new, 3, 2).update == [0, 1]
    # scale: missing indexes created, surplus deleted highest index first and never updated
    p = fleet.plan({0: new, 3: old, 2: old}, {0: True, 2: True, 3: True}, new, 2, 1)
    assert (p.create, p.delete, p.update) == ([1], [3, 2], [])


def test_fleet_status_is_the_worst_group_and_counts_ready_ones():
    def child(i, phase, makespan=None):
        status = {"phase": phase, **({"makespanSeconds": makespan} if makespan is not None else {})}
        return {"metadata": {"name": f"f-{i}", "labels": {fleet.LABEL_GROUP_INDEX: str(i)}}, "status": status}

    s = fleet.summary("f", [child(1, "Running", 7.5), child(0, "Running", 3.0), child(2, "Starting")],
                      {0: True, 1: True, 2: False}, 3)
    assert s["replicas"] == 3 and s["readyGroups"] == 2 and s["makespanSeconds"] == 7.5
    assert s["recentTtftP99Seconds"] is None and s["selector"] == f"{fleet.LABEL_FLEET}=f"
    assert [g["name"] for g in s["groups"]] == ["f-0", "f-1", "f-2"] and s["groups"][2] == \
        {"name": "f-2", "phase": "Starting", "ready": False}


def test_child_names_must_fit_the_name_limit():
    limit = builders.max_name_length()
    assert fleet.name_fits("a" * (limit - 2), 10, limit) and not fleet.name_fits("a" * (limit - 2), 11, limit)
    assert fleet.name_fits("a" * 200, 0, limit)


def _groups(cluster, ns, name) -> dict[int, dict]:
    items = cluster.get("pdrollouts", "-n", ns, "-l", f"{fleet.LABEL_FLEET}={name}")["items"]
    return {fleet.index_of(c): c for c in items if not c["metadata"].get("deletionTimestamp")}


def _serving(child: dict, pods: list[dict]) -> bool:
    """Every pod of the group Ready on its spec's template (the test's own reading, not the operator's)."""
    name = child["metadata"]["name"]
    want = builders.template_hash(name, child["metadata"]["namespace"], PDRolloutSpec.model_validate(child["spec"]))
    mine = [p for p in pods if p["metadata"]["labels"].get(builders.LABEL_ROLLOUT) == name
            and not p["metadata"].get("deletionTimestamp")]
    return len(mine) == child["spec"]["topology"]["nodes"] and all(
        p["metadata"]["annotations"].get(builders.TEMPLATE_HASH) == want and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])
        for p in mine)


class Watch:
    """Every event of one kind in a namespace (`kubectl get --watch`), as the API server sends them: a
    state held for less than a poll's interval is still seen (fake nodes start a pod at once)."""

    def __init__(self, cluster, kind: str, ns: str) -> None:
        self.events: list[tuple[int, str, dict]] = []
        self.proc = subprocess.Popen([cluster.tools["kubectl"], "get", kind, "-n", ns, "--watch",
                                      "--output-watch-events", "-o", "json"], env=cluster.env,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        buf, dec = "", json.JSONDecoder()
        for line in self.proc.stdout:
            buf += line
            while buf.strip():
                try:
                    ev, end = dec.raw_decode(buf.lstrip())
                except ValueError:
                    break
                buf = buf.lstrip()[end:]
                obj = ev["object"]
                self.events.append((int(obj["metadata"]["resourceVersion"]), ev["type"], obj))

    def stop(self) -> list[tuple[int, str, dict]]:
        self.proc.terminate()
        self.proc.wait(10)
        self.reader.join(10)
        return self.events


def _states(pod_events, child_events, image: str, since: int) -> list[dict]:
    """The fleet's state {group: (on the new image, serving)} just before resource version `since` and
    after each later event of both kinds, in the order etcd committed them (one etcd: resource
    versions are its revisions). A watch's list gives each object's last version, not its history,
    so only the states from `since` on (after the lists) are a history."""
    pods, children, out = {}, {}, []

    def state() -> dict:
        return {fleet.index_of(c): (c["spec"]["image"] == image, _serving(c, list(pods.values())))
                for c in children.values()}

    for rv, kind, obj, store in sorted([(*e, pods) for e in pod_events] + [(*e, children) for e in child_events],
                                       key=lambda e: e[0]):
        if rv >= since and not out:
            out.append(state())
        if kind == "DELETED" or obj["metadata"].get("deletionTimestamp"):
            store.pop(obj["metadata"]["name"], None)
        else:
            store[obj["metadata"]["name"]] = obj
        if out:
            out.append(state())
    return out


@pytest.mark.cluster
def test_replicas_scale_and_one_group_at_a_time(cluster, operator, namespace, wait):
    doc = cpu_doc(2)
    name = doc["metadata"]["name"]
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))

    def fleet_ready(n):
        def check():
            r = cluster.get("pdrollout", name, "-n", namespace)
            s = r.get("status") or {}
            return r if s.get("readyGroups") == s.get("replicas") == n and \
                s.get("observedGeneration") == r["metadata"]["generation"] and s.get("phase") == "Running" else None
        return check

    pdr = wait("two groups ready", fleet_ready(2), timeout=90)
    groups = _groups(cluster, namespace, name)
    assert sorted(groups) == [0, 1]
    for i, child in groups.items():
        assert child["metadata"]["ownerReferences"][0]["uid"] == pdr["metadata"]["uid"]
        assert "replicas" not in child["spec"] and child["spec"]["image"] == doc["spec"]["image"]
        cluster.get("statefulset", fleet.child_name(name, i), "-n", namespace)
    # the parent runs no group of its own; its client Service selects every group's node 0
    assert cluster.kubectl("get", "statefulset", name, "-n", namespace, check=False).returncode != 0
    svc = cluster.get("service", builders.api_service_name(name), "-n", namespace)
    behind = cluster.get("pods", "-n", namespace, "-l", ",".join(f"{k}={v}" for k, v in svc["spec"]["selector"].items()))
    assert sorted(p["metadata"]["name"] for p in behind["items"]) == [f"{name}-0-0", f"{name}-1-0"]
    assert [g["name"] for g in pdr["status"]["groups"]] == [f"{name}-0", f"{name}-1"]
    assert pdr["status"]["selector"] == f"{fleet.LABEL_FLEET}={name}"
    assert len(cluster.get("pods", "-n", namespace, "-l", pdr["status"]["selector"])["items"]) == 4

    cluster.kubectl("scale", f"pdrollout/{name}", "-n", namespace, "--replicas", "3")
    wait("three groups ready", fleet_ready(3), timeout=90)
    # an image update reaches the three groups at once: maxUnavailableGroups (1) holds across them, in order
    image = doc["spec"]["image"] + "-next"
    watches = Watch(cluster, "pods", namespace), Watch(cluster, "pdrollouts", namespace)
    try:
        # a watch's first events are its list: from then on, every change after it is sent
        wait("both watches listing", lambda: all(w.events for w in watches), timeout=30)
        since = int(json.loads(cluster.kubectl("patch", "pdrollout", name, "-n", namespace, "--type=merge", "-o", "json",
                                               "-p", json.dumps({"spec": {"image": image}})).stdout)
                    ["metadata"]["resourceVersion"])

        def history() -> list[dict]:
            pods, pdrs = (list(w.events) for w in watches)
            return _states(pods, [e for e in pdrs if fleet.LABEL_FLEET in e[2]["metadata"].get("labels", {})],
                           image, since)

        wait("the three groups serving on the new image",
             lambda: (h := history()) and h[-1] == {i: (True, True) for i in range(3)}, timeout=180)
    finally:
        for w in watches:
            w.stop()
    seen = history()
    assert seen[0] == {i: (False, True) for i in range(3)}, seen[0]
    assert seen[-1] == {i: (True, True) for i in range(3)}, seen[-1]
    assert max(sum(not ok for _, ok in s.values()) for s in seen) <= 1, seen
    assert any(s.get(0) == (True, False) for s in seen), "group 0 was never seen updating"
    for i in (1, 2):
        first = next(s for s in seen if s[i][0])
        assert first[i - 1] == (True, True), f"group {i} got the image before group {i - 1} served on it: {first}"
    wait("the fleet Running on the new image", fleet_ready(3), timeout=60)
    kept = {i: (c["metadata"]["uid"], c["metadata"]["generation"]) for i, c in _groups(cluster, namespace, name).items()}
    cluster.kubectl("scale", f"pdrollout/{name}", "-n", namespace, "--replicas", "2")
    wait("group 2 removed", lambda: sorted(_groups(cluster, namespace, name)) == [0, 1], timeout=60)
    wait("its StatefulSet gone", lambda: cluster.kubectl(
        "get", "statefulset", fleet.child_name(name, 2), "-n", namespace, check=False).returncode != 0, timeout=60)
    pdr = wait("two groups ready again", fleet_ready(2), timeout=60)
    assert {i: (c["metadata"]["uid"], c["metadata"]["generation"])
            for i, c in _groups(cluster, namespace, name).items()} == {i: kept[i] for i in (0, 1)}

    # the router discovers every group's API pod; a fleet-only field rolls no group
    cluster.kubectl("patch", "pdrollout", name, "-n", namespace, "--type=merge",
                    "-p", json.dumps({"spec": {"router": {"policy": "round_robin"}}}))
    dep = wait("the router Deployment", lambda: json.loads(r.stdout) if (r := cluster.kubectl(
        "get", "deployment", router.name_of(name), "-n", namespace, "-o", "json", check=False)).returncode == 0
        else None, timeout=60)
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    selector = args[args.index("--selector") + 1:args.index("--service-discovery-port")]
    assert len(cluster.get("pods", "-n", namespace, "-l", ",".join(selector))["items"]) == 2, selector
    wait("the client Service on the router", lambda: cluster.get(
        "service", builders.api_service_name(name), "-n", namespace)["spec"]["selector"] == {router.LABEL_ROUTER: name})
    assert {i: (c["metadata"]["uid"], c["metadata"]["generation"])
            for i, c in _groups(cluster, namespace, name).items()} == {i: kept[i] for i in (0, 1)}

    assert cluster.get("pdrollouts", "-n", namespace, "-o", "wide")   # printer columns accepted


@pytest.mark.cluster
def test_one_group_becomes_a_fleet_and_back(cluster, operator, namespace, wait):
    """Setting spec.replicas on a running group parks its StatefulSet at 0 (the chart grants no delete)
    and starts the groups; unsetting it deletes the groups and the StatefulSet runs the group again."""
    doc = yaml.safe_load((ROOT / "examples/pdrollout-cpu.yaml").read_text())
    name, nodes = doc["metadata"]["name"], doc["spec"]["topology"]["nodes"]
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))

    def replicas():
        return cluster.get("statefulset", name, "-n", namespace)["spec"]["replicas"]

    wait("the group's StatefulSet", lambda: cluster.kubectl(
        "get", "statefulset", name, "-n", namespace, check=False).returncode == 0, timeout=60)
    assert replicas() == nodes
    cluster.kubectl("patch", "pdrollout", name, "-n", namespace, "--type=merge", "-p", '{"spec": {"replicas": 1}}')
    wait("group 0 created", lambda: sorted(_groups(cluster, namespace, name)) == [0], timeout=60)
    wait("the StatefulSet at 0", lambda: replicas() == 0, timeout=60)
    cluster.kubectl("patch", "pdrollout", name, "-n", namespace, "--type=json",
                    "-p", '[{"op": "remove", "path": "/spec/replicas"}]')
    wait("group 0 deleted", lambda: not _groups(cluster, namespace, name), timeout=60)
    wait("the StatefulSet back at its nodes", lambda: replicas() == nodes, timeout=60)
