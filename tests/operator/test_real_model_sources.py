"""Model storage on the real nodes (e2e/cluster/start.sh DIR --real-nodes 2), under the chart's operator:
a CPU PDRollout whose model comes from a PVC bound to a local PV, from a hostPath, and from a node-local
cache an init container fills from that PVC, each reaches Running with its probes, preStop and grace in the
live pod and answers a replay through its client Service; a model path with no model gives a ConfigError
condition whose message names the path. Sorted before test_real_nodes.py, which uninstalls the chart."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from real_cluster import RealCluster

from pdrollout.operator.builders import LABEL_ROLLOUT, api_service_name
from pdrollout.operator.builders import ENGINE_UID
from pdrollout.operator.storage import COMPLETE

pytestmark = [pytest.mark.cluster, pytest.mark.real_nodes]

ROOT = Path(__file__).resolve().parents[2]
CPU_EXAMPLE = ROOT / "examples" / "pdrollout-cpu.yaml"


@pytest.fixture
def model_dir():
    """A tiny checkpoint on this machine's disk, which the nodes share: readable by the engine's user
    (every directory above it too), removed afterwards."""
    top = Path(tempfile.mkdtemp(prefix="pdr-models-", dir="/var/tmp"))
    top.chmod(0o755)
    subprocess.run([sys.executable, "-m", "pdrollout.engine.cli", "checkpoint", "--config", "tiny", "--out",
                    str(top / "tiny"), "--seed", "0"], check=True, capture_output=True, timeout=300)
    (top / "empty").mkdir()
    cache = top / "cache"
    cache.mkdir()
    os.chown(cache, ENGINE_UID, ENGINE_UID)     # the cache fill runs as the CPU engine's user
    for p in top.rglob("*"):
        p.chmod(p.stat().st_mode | 0o755 if p.is_dir() else p.stat().st_mode | 0o644)
    yield top
    shutil.rmtree(top, ignore_errors=True)


def _rollout(c: RealCluster, name: str, path: str, source: dict) -> dict:
    """One pod of 2 CPU ranks (EP2): the example's engine, its model from `source`, mounted at `path`."""
    doc = yaml.safe_load(CPU_EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    spec = doc["spec"]
    spec["image"] = c.info["ENGINE_IMAGE"]
    spec["model"] = {**spec["model"], "path": path, "source": source}
    spec["topology"] = {"nodes": 1, "gpusPerNode": 2, "expertParallel": 2, "attentionDataParallel": 1}
    spec["resources"] = {"cpu": "1", "memory": "3Gi", "sharedMemory": "256Mi"}
    spec["lifecycle"] = {"startupSeconds": 600, "livenessSeconds": 60, "drainSeconds": 5}
    return doc


def _status(c: RealCluster, ns: str, name: str) -> dict:
    return c.get("pdrollout", name, "-n", ns).get("status", {})


def _replay(c: RealCluster, ns: str, name: str, port: int, tmp: Path) -> dict:
    trace, out = tmp / f"{name}.jsonl", tmp / f"{name}-bench"
    trace.write_text("".join(json.dumps({"session_id": f"s{s}", "turn": t, "input_length": 10 + 4 * s,
                                         "output_length": 5, "delay_ms": 0}) + "\n"
                             for s in range(2) for t in range(2)))
    svc = c.get("service", api_service_name(name), "-n", ns)
    c.run(sys.executable, "-m", "pdrollout.engine.cli", "bench", "--url", f"http://{svc['spec']['clusterIP']}:{port}",
          "--trace", str(trace), "--pressure", "P1", "--out", str(out), "--no-progress", node=0, timeout=300)
    return json.loads((out / "results.json").read_text())["modes"]["server"]


def _run_and_replay(c: RealCluster, ns: str, doc: dict, tmp: Path, wait) -> dict:
    name, port = doc["metadata"]["name"], doc["spec"]["port"]
    c.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
    st = wait(f"{name} Running", lambda: (s := _status(c, ns, name)).get("phase") == "Running" and s,
              timeout=420, interval=2)
    (pod,) = c.get("pods", "-n", ns, "-l", f"{LABEL_ROLLOUT}={name}")["items"]
    (engine,) = pod["spec"]["containers"]
    assert engine["startupProbe"]["httpGet"]["path"] == "/health"
    assert engine["livenessProbe"]["httpGet"]["path"] == "/live?bound_s=60"
    assert engine["lifecycle"]["preStop"]["exec"]["command"][2] == "pdrollout.engine.server.lifecycle"
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 5
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
    code, body = c.http(f"http://{pod['status']['podIP']}:{port}/live?bound_s=60")
    assert code == 200 and json.loads(body)["status"] == "ok", body
    bench = _replay(c, ns, name, port, tmp)
    assert bench["completed"] == 4 and bench["stalls"] == 0, bench
    c.kubectl("delete", "pdrollout", name, "-n", ns, "--wait=true", timeout=120)
    wait(f"{name}'s pods gone", lambda: not c.get("pods", "-n", ns, "-l", f"{LABEL_ROLLOUT}={name}")["items"],
         timeout=120)
    return {"pod": pod, "status": st}


def test_model_sources_on_real_nodes(real_cluster, real_operator, real_namespace, model_dir, tmp_path, wait):
    c, ns = real_cluster, real_namespace
    t0 = time.monotonic()
    # --- a hostPath: the model directory on the node, mounted where the engine reads it.
    got = _run_and_replay(c, ns, _rollout(c, "from-host", "/models/from-host",
                                          {"hostPath": {"path": str(model_dir / "tiny")}}), tmp_path, wait)
    vol = next(v for v in got["pod"]["spec"]["volumes"] if v["name"] == "pdrollout-model")
    assert vol["hostPath"]["path"] == str(model_dir / "tiny")

    # --- a PVC bound to a local PV on node-0 (the PV controller binds it; the scheduler follows the PV).
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{ns}-models"},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                   "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "pdr-local",
                   "local": {"path": str(model_dir)},
                   "claimRef": {"namespace": ns, "name": "models"},
                   "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                       {"key": "kubernetes.io/hostname", "operator": "In", "values": ["node-0"]}]}]}}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models", "namespace": ns},
           "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "pdr-local", "volumeName": pv["metadata"]["name"],
                    "resources": {"requests": {"storage": "1Gi"}}}}
    c.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [pv, pvc]}))
    try:
        wait("PVC bound", lambda: c.get("pvc", "models", "-n", ns)["status"].get("phase") == "Bound", timeout=60)
        got = _run_and_replay(c, ns, _rollout(c, "from-pvc", "/models/from-pvc",
                                              {"pvc": {"claimName": "models", "subPath": "tiny"}}), tmp_path, wait)
        assert got["pod"]["spec"]["nodeName"] == "node-0"

        # --- a node-local cache filled by the init container from the same PVC, then found complete.
        cache = model_dir / "cache"
        got = _run_and_replay(c, ns, _rollout(c, "from-cache", "/models/from-cache", {"cache": {
            "pvc": {"claimName": "models", "subPath": "tiny"}, "hostPath": str(cache)}}), tmp_path, wait)
        (fill,) = got["pod"]["status"]["initContainerStatuses"]
        assert fill["name"] == "model-cache" and fill["state"]["terminated"]["exitCode"] == 0, fill
        assert (cache / COMPLETE).exists() and (cache / "config.json").read_bytes() == \
            (model_dir / "tiny" / "config.json").read_bytes()

        # --- no model at the path: the engine exits with the config code, the condition says where.
        name = "no-model"
        doc = _rollout(c, name, "/models/missing", {"hostPath": {"path": str(model_dir / "empty")}})
        c.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
        st = wait("ConfigError", lambda: (s := _status(c, ns, name)) and any(
            x["type"] == "ConfigError" and x["status"] == "True" for x in s.get("conditions", [])) and s,
            timeout=300, interval=2)
        cond = next(x for x in st["conditions"] if x["type"] == "ConfigError")
        assert "/models/missing/config.json not found" in cond["message"], cond
        assert cond["message"].startswith(f"container engine of pod {name}-0 exited with the config code 2"), cond
        assert st["phase"] != "Running"
        c.kubectl("delete", "pdrollout", name, "-n", ns, "--wait=true", timeout=120)
    finally:
        c.kubectl("delete", "pvc", "models", "-n", ns, "--wait=false", check=False)
        c.kubectl("delete", "pv", pv["metadata"]["name"], "--wait=false", check=False)
    print(f"\n[real-nodes] model sources: {time.monotonic() - t0:.0f}s", file=sys.stderr)
