"""A fleet on the real nodes (issue 50, must show 1-4): a CPU PDRollout with `replicas: 2` and
`router: {policy: manual}` under the chart's operator reaches Running, the tiny trace replayed through the
router's client Service keeps each session on one engine (continuation turns hit its prefix cache), and a
round-robin control in the same test loses much of that; one pod of group 1 is deleted: only group 1
restarts, and requests through the router meanwhile either complete on group 0 or fail with an HTTP status,
none hanging; an image update rolls one group at a time and `kubectl scale` adds a third group and takes
it away again, while requests through the router keep completing (each one counted). Sorted before
test_real_nodes.py, which uninstalls the chart."""
from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from real_cluster import RealCluster

from pdrollout.engine.protocol.router import ROUTING_KEY_HEADER
from pdrollout.engine.workload.trace import PRESETS
from pdrollout.operator.builders import LABEL_ROLLOUT, api_service_name
from pdrollout.operator.fleet import LABEL_FLEET, child_name
from pdrollout.operator.router import LABEL_ROUTER

pytestmark = [pytest.mark.cluster, pytest.mark.real_nodes]

ROOT = Path(__file__).resolve().parents[2]
CPU_EXAMPLE = ROOT / "examples" / "pdrollout-cpu.yaml"
NAME = "fleet"
TINY = PRESETS["tiny"]     # the trace every replay here sends
REQUEST_BOUND_S = 30      # no request through the router may take longer while a group restarts


def _fleet(c: RealCluster) -> dict:
    """The CPU example as two one-pod groups of 2 ranks (EP2) behind a manual-policy router, sized so that
    both groups and the router fit the two nodes (they share this machine's cores)."""
    doc = yaml.safe_load(CPU_EXAMPLE.read_text())
    doc["metadata"]["name"] = NAME
    spec = doc["spec"]
    spec["image"] = c.info["ENGINE_IMAGE"]
    spec["topology"] = {"nodes": 1, "gpusPerNode": 2, "expertParallel": 2, "attentionDataParallel": 1}
    spec["resources"] = {"cpu": "1", "memory": "3Gi", "sharedMemory": "256Mi"}
    spec["lifecycle"] = {"drainSeconds": 5}
    spec["replicas"] = 2
    spec["router"] = {"policy": "manual", "cpu": "500m", "memory": "512Mi"}
    return doc


def _ready(pod: dict) -> bool:
    return any(x["type"] == "Ready" and x["status"] == "True" for x in pod["status"].get("conditions", []))


def _live(c: RealCluster, ns: str, selector: str) -> list[dict]:
    return [p for p in c.get("pods", "-n", ns, "-l", selector)["items"] if not p["metadata"].get("deletionTimestamp")]


def _group_pod(c: RealCluster, ns: str, i: int) -> dict | None:
    pods = _live(c, ns, f"{LABEL_ROLLOUT}={child_name(NAME, i)}")
    return pods[0] if len(pods) == 1 else None


def _status(c: RealCluster, ns: str, name: str = NAME) -> dict:
    return c.get("pdrollout", name, "-n", ns).get("status", {})


def _router_rolled(c: RealCluster, ns: str, policy: str) -> bool:
    """Every router pod alive runs `policy` and is Ready (the old ones are gone)."""
    pods = _live(c, ns, f"{LABEL_ROUTER}={NAME}")
    if not pods or len(c.get("pods", "-n", ns, "-l", f"{LABEL_ROUTER}={NAME}")["items"]) != len(pods):
        return False
    return all(_ready(p) and policy in p["spec"]["containers"][0]["args"] for p in pods)


def _bench(c: RealCluster, url: str, out: Path, seed: int = 0) -> dict:
    """The tiny preset replayed through the router from node-0's namespace (kube-proxy on the Service IP);
    another seed draws other token ids, so a run finds no prefix an earlier one left."""
    c.run(sys.executable, "-m", "pdrollout.engine.cli", "bench", "--url", url, "--preset", "tiny", "--pressure", "P1",
          "--seed", str(seed), "--no-progress", "--out", str(out), node=0, timeout=300)
    return json.loads((out / "results.json").read_text())["modes"]["server"]


def _probe_requests(c: RealCluster, url: str, stop: threading.Event, got: list) -> None:
    """One /generate after another through the router, routing keys cycling so both groups are asked;
    each (key, status, body, seconds). curl's -m makes a hang show as status 0."""
    n = 0
    while not stop.is_set():
        key = f"probe-{n % 8}"
        body = json.dumps({"input_ids": [3, 4, 5, 6 + n % 8], "sampling_params": {"max_new_tokens": 2}})
        cmd = ["curl", "-sS", "-m", str(REQUEST_BOUND_S), "-X", "POST", "-H", "Content-Type: application/json",
               "-H", f"{ROUTING_KEY_HEADER}: {key}", "--data-binary", body, "-o", "-", "-w", "\n%{http_code}",
               f"{url}/generate"]
        t0 = time.monotonic()
        r = c.run(*cmd, node=0, check=False, timeout=REQUEST_BOUND_S + 15)
        text, _, code = r.stdout.rpartition("\n")
        got.append((key, int(code or 0), text or r.stderr.strip(), time.monotonic() - t0))
        n += 1


@contextlib.contextmanager
def _probing(c: RealCluster, url: str):
    """Requests through the router for as long as the block runs, once one has answered; yields the list
    the answers land in (those from before the block's work are dropped when it ends)."""
    stop, got = threading.Event(), []
    prober = threading.Thread(target=_probe_requests, args=(c, url, stop, got), daemon=True)
    prober.start()
    try:
        end = time.monotonic() + 60
        while not any(code == 200 for _, code, _, _ in got):
            assert time.monotonic() < end and prober.is_alive(), f"no probe answered: {got[-3:]}"
            time.sleep(0.5)
        first = len(got)
        yield got
        del got[:first]
    finally:
        stop.set()
        prober.join(REQUEST_BOUND_S + 20)


def _all_served(what: str, got: list) -> set[str]:
    """Every probe completed (none failed, none hung); returns the pods that answered them."""
    failed = [(k, code, body[:200]) for k, code, body, _ in got if code != 200]
    print(f"\n[real-fleet] {what}: {len(got)} requests, {len(failed)} failed", file=sys.stderr)
    assert got and not failed, failed
    assert all(s < REQUEST_BOUND_S for *_, s in got)
    return {_served_by(body) for _, _, body, _ in got}


def _served_by(body: str) -> str:
    return json.loads(body)["meta_info"]["served_by"].split(":")[0]


def _ctr(c: RealCluster, node: int, *args: str, check: bool = True):
    sock = c.dir / "nodes" / f"node-{node}" / "containerd.sock"
    return c.run("ctr", "--address", str(sock), "-n", "k8s.io", *args, check=check)


@pytest.mark.timeout(1500)
def test_fleet_behind_the_router_on_real_nodes(real_cluster, real_operator, real_namespace, tmp_path, wait):
    c, ns = real_cluster, real_namespace
    doc = _fleet(c)
    port = doc["spec"]["port"]
    times, t0 = {}, time.monotonic()

    def lap(what: str) -> None:
        nonlocal t0
        times[what] = round(time.monotonic() - t0, 1)
        t0 = time.monotonic()

    # --- 1. two groups and the router: Running, both groups ready, the router pod ready.
    c.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
    st = wait("the fleet Running", lambda: (s := _status(c, ns)).get("phase") == "Running" and s,
              timeout=300, interval=2)
    assert st["readyGroups"] == 2 and st["replicas"] == 2, st
    assert {g["name"] for g in st["groups"]} == {child_name(NAME, 0), child_name(NAME, 1)}, st
    wait("the router Ready", lambda: _router_rolled(c, ns, "manual"), timeout=120)
    lap("fleet Running")
    engines = [_group_pod(c, ns, i) for i in range(2)]
    assert all(p and _ready(p) and p["metadata"]["labels"][LABEL_FLEET] == NAME for p in engines), engines
    svc = c.get("service", api_service_name(NAME), "-n", ns)
    assert svc["spec"]["selector"] == {LABEL_ROUTER: NAME}, svc["spec"]
    url = f"http://{svc['spec']['clusterIP']}:{port}"

    sticky = _bench(c, url, tmp_path / "manual")
    lap("manual replay")
    assert sticky["completed"] == TINY.requests, sticky
    assert sticky["continuation_cached_share"] >= 0.9, sticky
    # the per-engine groups are the pods behind the router (the engine's served_by names its pod)
    assert 1 <= sticky["engines"] == len(sticky["groups"]) <= 2, sticky["groups"]
    assert sum(g["requests"] for g in sticky["groups"].values()) == sticky["completed"]

    # ... the control: round_robin, the router rolled, a trace of other token ids.
    c.kubectl("patch", "pdrollout", NAME, "-n", ns, "--type=merge",
              "-p", json.dumps({"spec": {"router": {"policy": "round_robin"}}}))
    wait("the router on round_robin", lambda: _router_rolled(c, ns, "round_robin"), timeout=120, interval=1)
    assert {p["metadata"]["uid"] for p in engines} == \
        {_group_pod(c, ns, i)["metadata"]["uid"] for i in range(2)}   # the engines did not restart
    control = _bench(c, url, tmp_path / "round_robin", seed=1)
    lap("router rolled, round_robin replay")
    assert control["completed"] == TINY.requests, control
    assert control["engines"] == 2, control["groups"]
    # the margin tests/server/test_fleet_router.py uses
    assert control["continuation_cached_share"] < sticky["continuation_cached_share"], (sticky, control)
    assert control["continuation_cached_ratio"] < sticky["continuation_cached_ratio"] - 0.05, (sticky, control)

    # --- 3. group 1's pod deleted while requests go through the router: only group 1 restarts.
    before = {i: (p["metadata"]["uid"], p["status"]["containerStatuses"][0]["restartCount"])
              for i, p in enumerate(engines)}
    restarts0 = _status(c, ns, child_name(NAME, 0)).get("groupRestarts") or 0
    with _probing(c, url) as got:
        c.kubectl("delete", "pod", engines[1]["metadata"]["name"], "-n", ns, "--wait=false")

        def group1_back():
            p = _group_pod(c, ns, 1)
            return p and p["metadata"]["uid"] != before[1][0] and _ready(p) and p
        wait("group 1 Ready again", group1_back, timeout=240, interval=1)
        wait("the fleet Running again", lambda: (s := _status(c, ns)).get("readyGroups") == 2 and
             s.get("phase") == "Running", timeout=120, interval=1)
        time.sleep(3)    # a few requests more once group 1 is back
    lap("group 1 restarted under requests")
    during = got
    failed = [(k, code, body[:200]) for k, code, body, _ in during if code != 200]
    print(f"\n[real-fleet] {len(during)} requests while group 1 restarted, {len(failed)} failed: "
          f"{sorted({(code, body) for _, code, body in failed})}", file=sys.stderr)
    # none hung past the bound, and each failure is an HTTP status with a body saying why
    assert all(code != 0 and s < REQUEST_BOUND_S for _, code, _, s in during), [g for g in during if g[1] == 0]
    assert all(code >= 400 and body for _, code, body in failed), failed
    # group 0 kept serving: most requests completed
    assert len(during) - len(failed) > len(failed), (during, failed)
    g0 = _group_pod(c, ns, 0)
    assert (g0["metadata"]["uid"], g0["status"]["containerStatuses"][0]["restartCount"]) == before[0], g0["status"]
    assert (_status(c, ns, child_name(NAME, 0)).get("groupRestarts") or 0) == restarts0
    assert (_status(c, ns, child_name(NAME, 1)).get("groupRestarts") or 0) >= 1

    # ... and a whole replay through the router completes on both groups again.
    after = _bench(c, url, tmp_path / "after")
    lap("replay after the restart")
    assert after["completed"] == TINY.requests, after
    print(f"\n[real-fleet] steps (s): {times}; cached share manual {sticky['continuation_cached_share']}, "
          f"round_robin {control['continuation_cached_share']}", file=sys.stderr)

    # --- 4. an image update rolls one group at a time; every request meanwhile completes. The new image is
    # the engine image under a second name on every node (the pods' pull policy is Never).
    image = c.info["ENGINE_IMAGE"].rsplit(":", 1)[0] + ":fleet-next"
    for i in range(len(c.nodes)):
        _ctr(c, i, "images", "tag", "--force", c.info["ENGINE_IMAGE"], image)
    old_pods = {i: _group_pod(c, ns, i)["metadata"]["uid"] for i in range(2)}
    ready_at: dict[int, float] = {}     # when each group's pod on the new image was Ready
    gone_at: dict[int, float] = {}      # when each group's old pod was gone
    serving = []                        # groups Ready at each look
    try:
        with _probing(c, url) as got:
            c.kubectl("patch", "pdrollout", NAME, "-n", ns, "--type=merge", "-p", json.dumps({"spec": {"image": image}}))

            def rolled():
                pods = {i: _group_pod(c, ns, i) for i in range(2)}
                now = time.monotonic()
                for i, p in pods.items():
                    if not p or p["metadata"]["uid"] != old_pods[i]:
                        gone_at.setdefault(i, now)
                    if p and p["spec"]["containers"][0]["image"] == image and _ready(p):
                        ready_at.setdefault(i, now)
                serving.append(sum(bool(p and _ready(p)) for p in pods.values()))
                return len(ready_at) == 2 and _status(c, ns).get("readyGroups") == 2
            wait("both groups on the new image", rolled, timeout=360, interval=1)
        lap("image rolled under requests")
        _all_served("image update", got)
        first, second = sorted(gone_at, key=gone_at.get)
        # the second group went down only once the first served on the new image; one always served
        assert gone_at[second] >= ready_at[first], (gone_at, ready_at)
        assert min(serving) >= 1, serving

        # --- 2. `kubectl scale` to 3: the third group joins the router; back to 2: it drains and goes.
        with _probing(c, url) as got:
            c.kubectl("scale", f"pdrollout/{NAME}", "-n", ns, "--replicas", "3")
            wait("three groups ready", lambda: (s := _status(c, ns)).get("readyGroups") == 3 and
                 s.get("phase") == "Running", timeout=300, interval=1)
            third = _group_pod(c, ns, 2)["metadata"]["name"]
            # the router is round_robin now: the probes reach every engine once it has found the third
            wait("the router sending to the third group",
                 lambda: third in {_served_by(b) for _, code, b, _ in got[-12:] if code == 200}, timeout=60, interval=1)
        lap("scaled to 3 under requests")
        assert len(_all_served("scale to 3", got)) == 3
        with _probing(c, url) as got:
            c.kubectl("scale", f"pdrollout/{NAME}", "-n", ns, "--replicas", "2")
            wait("the third group gone", lambda: not _live(c, ns, f"{LABEL_ROLLOUT}={child_name(NAME, 2)}") and
                 (s := _status(c, ns)).get("readyGroups") == 2 and s.get("replicas") == 2, timeout=180, interval=1)
            time.sleep(3)
        lap("scaled back to 2 under requests")
        assert third not in {_served_by(b) for _, _, b, _ in got[-4:]}
        _all_served("scale back to 2", got)
        left = {d["metadata"]["name"] for d in c.get("pdrollout", "-n", ns)["items"]}
        assert left == {NAME, child_name(NAME, 0), child_name(NAME, 1)}, left
    finally:
        for i in range(len(c.nodes)):
            _ctr(c, i, "images", "rm", image, check=False)
    print(f"\n[real-fleet] steps (s): {times}", file=sys.stderr)
