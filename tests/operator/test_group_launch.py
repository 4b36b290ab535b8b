"""A two-pod `device: cpu` PDRollout against the real API server: the pods the StatefulSet controller
made (fake nodes give them loopback IPs) are run as real process trees with exactly their own
command, args and env (e2e/harness/pod_launch.py), so the operator reads one engine across both pods.
Node 0 is the API (client Service `<name>-api`), controls go to node 0 and reach every rank without a
restart, a killed node ends the group with the peer-lost code and the operator recreates the group,
and an engine exit with the stall code sets the Stalled condition."""
import json
import signal
from pathlib import Path

import pytest
import yaml

from pdrollout.engine.protocol.exits import EXIT_PEER_LOST, EXIT_STALL
from pod_launch import free_port, http, launch, report_exit, wait_health, write_config, write_secret

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


def status(cluster, ns, name) -> dict:
    return cluster.get("pdrollout", name, "-n", ns).get("status", {})


def cond(st: dict, type_: str) -> dict:
    return next((c for c in st.get("conditions", []) if c["type"] == type_), {})


def test_two_pod_group_through_the_operator(cluster, operator, namespace, tiny_model, tmp_path, wait):
    ns = namespace
    doc = yaml.safe_load((ROOT / "examples/pdrollout-cpu.yaml").read_text())
    name = doc["metadata"]["name"]
    doc["spec"]["model"]["path"] = str(tiny_model)
    doc["spec"]["port"] = port = free_port()
    doc["spec"]["speculative"] = {"method": "ngram", "k": 2}   # a start-time field, through the ConfigMap
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))

    def running():
        pods = cluster.get("pods", "-n", ns, "-l", f"pdrollout.io/rollout={name}")["items"]
        live = sorted((p for p in pods if not p["metadata"].get("deletionTimestamp")
                       and p["status"].get("phase") == "Running" and p["status"].get("podIP")),
                      key=lambda p: p["metadata"]["name"])
        return live if len(live) == 2 else None

    pods = wait("both pods Running", running, timeout=60)
    assert all(p["status"]["podIP"].startswith("127.") for p in pods)
    svc = cluster.get("service", f"{name}-api", "-n", ns)
    assert svc["spec"]["selector"] == {"pdrollout.io/rollout": name, "apps.kubernetes.io/pod-index": "0"}

    # Each pod's own container (as the API server has it), its own IP, the mounted ConfigMap.
    ips = [p["status"]["podIP"] for p in pods]
    config = write_config(cluster.get("configmap", f"{name}-engine", "-n", ns), tmp_path / "config", ips[0],
                          free_port())
    secret = write_secret(cluster.get("secret", f"{name}-admin", "-n", ns), tmp_path / "admin")
    procs = [launch(p["spec"]["containers"][0], pod_name=p["metadata"]["name"],
                    node_rank=int(p["metadata"]["labels"]["apps.kubernetes.io/pod-index"]), pod_ip=p["status"]["podIP"],
                    config_dir=config, log=tmp_path / f"{p['metadata']['name']}.log", secret_dir=secret)
             for p in pods]
    urls = [f"http://{ip}:{port}" for ip in ips]
    try:
        wait_health(procs[0], urls[0], 200, timeout=240)
        wait_health(procs[1], urls[1], 200, timeout=60)
        st = wait("Running", lambda: (s := status(cluster, ns, name)).get("phase") == "Running" and s, timeout=60)
        assert cond(st, "Ready")["status"] == "True" and st["readyNodes"] == 2
        code, out = http(f"{urls[0]}/generate", {"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
        assert code == 200 and len(out["output_ids"]) == 4
        code, info = http(f"{urls[0]}/get_model_info")
        assert code == 200 and (info["speculative"], info["speculative_k"], info["nproc"]) == ("ngram", 2, 4), info

        # A live control change: node 0 takes it for every rank; no pod restarts.
        uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
        cluster.kubectl("patch", "pdrollout", name, "-n", ns, "--type=merge", "-p", json.dumps(
            {"spec": {"multiplexing": {"span": 3, "ordering": "global-enqueue"}}}))
        wait("node 0's /control to change",
             lambda: http(f"{urls[0]}/control")[1] == {"activation": "on", "span": 3, "prefill_budget_tokens": 64,
                                                       "ordering": "global-enqueue", "p_wait_bound_ms": None,
                                                       "p_gather_ms": None, "p_burst_first": None},
             timeout=30, interval=0.3)
        code, out = http(f"{urls[0]}/generate", {"input_ids": [8, 9], "sampling_params": {"max_new_tokens": 3}})
        assert code == 200 and all(p.proc.poll() is None for p in procs)
        assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in running()} == uids

        # Node 1 dies: node 0 ends with the peer-lost code; reported, the operator recreates the group.
        procs[1].kill_tree(signal.SIGKILL)
        assert procs[0].proc.wait(60) == EXIT_PEER_LOST, procs[0].tail()
        report_exit(cluster, ns, pods[1], 128 + signal.SIGKILL)
        report_exit(cluster, ns, pods[0], EXIT_PEER_LOST, gone_ok=True)   # may be deleted on pod 1's report
        wait("the group recreated", lambda: (new := running()) and all(
            p["metadata"]["uid"] != uids[p["metadata"]["name"]] for p in new), timeout=90)
        events = cluster.get("events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]
        restarts = [e["message"] for e in events if e["reason"] == "GroupRestart"]
        assert restarts and any("exit 4 (peer lost)" in m or "exit 137" in m for m in restarts), restarts
        st = status(cluster, ns, name)
        assert st["groupRestarts"] == 1 and cond(st, "Stalled")["status"] == "False"

        # An engine exits with the stall code: Stalled, counted once, with an event.
        new = running()
        report_exit(cluster, ns, new[0], EXIT_STALL)
        st = wait("Stalled", lambda: (s := status(cluster, ns, name)) and cond(s, "Stalled").get("status") == "True"
                  and s, timeout=30)
        stalled = cond(st, "Stalled")
        assert stalled["reason"] == "EngineStalled" and f"{name}-0" in stalled["message"], stalled
        assert st["stalls"] == 1 and st["lastStallTime"]
        events = cluster.get("events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]
        assert any(e["reason"] == "EngineStalled" and e["type"] == "Warning" for e in events)
    finally:
        for p in procs:
            p.kill_tree()
            p.proc.wait(30)
