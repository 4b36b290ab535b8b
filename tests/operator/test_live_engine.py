"""The engine-facing paths with a real engine process (`pdrollout serve`, CPU, tiny model) bound to the
rank-0 pod's loopback IP: health and metrics into status, live /control pushes without restarts,
drift correction, and Degraded when the engine dies."""
import base64
import importlib
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from chart_install import admin_token

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]


def http(url: str, body: dict | None = None, method: str | None = None, token: str | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"), headers=headers)
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


class Engine:
    def __init__(self, model: Path, host: str, port: int, log: Path, token_file: Path):
        try:
            importlib.import_module("pdrollout.engine.server.serve")
        except ImportError as e:
            pytest.fail(f"the engine server (pdrollout.engine.server, `pdrollout serve`) is missing: {e}")
        self.url = f"http://{host}:{port}"
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdrollout.engine.cli", "serve", "--model", str(model), "--host", host,
             "--port", str(port), "--mode", "pd", "--rollout-idle", "60", "--admin-token-file", str(token_file)],
            stdout=open(log, "wb"), stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout=120):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                pytest.fail(f"pdrollout serve exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if http(f"{self.url}/health").get("status") == "ok":
                    return
            except OSError:
                pass
            time.sleep(0.3)
        pytest.fail(f"pdrollout serve not healthy after {timeout}s:\n{self.log.read_text()[-3000:]}")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture
def live(cluster, operator, namespace, port, tiny_model, tmp_path, wait):
    """A one-node PDRollout whose rank-0 pod IP serves a real engine on the port the pod declares."""
    doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())
    doc["metadata"]["name"] = name = "live"
    doc["spec"]["port"] = port
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    pod = wait("pod Running", lambda: (p := cluster.kubectl("get", "pod", f"{name}-0", "-n", namespace, "-o",
                                                            "json", check=False)).returncode == 0
               and (o := json.loads(p.stdout))["status"].get("podIP") and o, timeout=60)
    ip = pod["status"]["podIP"]
    assert ip.startswith("127."), f"pod IP {ip} is not loopback"
    declared = pod["spec"]["containers"][0]["ports"][0]["containerPort"]
    # The token the pod mounts: the rollout's Secret, which only the operator wrote.
    secret = cluster.get("secret", f"{name}-admin", "-n", namespace)
    (tmp_path / "token").write_bytes(base64.b64decode(secret["data"]["token"]))
    engine = Engine(tiny_model, ip, declared, tmp_path / "engine.log", tmp_path / "token")
    engine.wait_healthy()
    yield {"name": name, "ns": namespace, "engine": engine, "pod": pod}
    engine.kill()


def status(cluster, ns, name) -> dict:
    return cluster.get("pdrollout", name, "-n", ns).get("status", {})


def test_health_and_metrics_reach_status_then_degraded(cluster, live, wait):
    name, ns, engine = live["name"], live["ns"], live["engine"]
    st = wait("Running", lambda: (s := status(cluster, ns, name)).get("phase") == "Running" and s, timeout=30)
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "EngineHealthy")

    # One rollout of real requests, finished by the client: makespan and TTFT appear in status.
    for i in range(3):
        out = http(f"{engine.url}/generate", {"input_ids": [1 + i, 2, 3, 4, 5], "rollout_id": "step-1",
                                              # ignore_eos: sampled at temperature 1, the tiny model
                                              # sometimes ends at once (seen: output_ids == [1])
                                              "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})
        assert len(out["output_ids"]) == 6
    fin = http(f"{engine.url}/rollout/finish", {"rollout_id": "step-1"})
    st = wait("makespan in status", lambda: (s := status(cluster, ns, name)).get("makespanSeconds") and s,
              timeout=30)
    assert st["makespanSeconds"] == pytest.approx(fin["makespan_s"], abs=5e-4)   # status keeps ms
    assert st["recentTtftP99Seconds"] > 0 and st["meanDecodeWaitSeconds"] >= 0 and "stalls" not in st
    table = cluster.kubectl("get", "pdr", name, "-n", ns).stdout.splitlines()[1].split()
    assert table[1:4] == ["Running", "1", "1"] and float(table[4]) == pytest.approx(fin["makespan_s"], abs=5e-4)

    # A trainer's weight update sets the engine's version: status shows it.
    assert http(f"{engine.url}/update_weight_version", {"new_version": "step-2"},
                token=admin_token(cluster, live["ns"], name))["success"]
    wait("weightVersion in status", lambda: status(cluster, ns, name).get("weightVersion") == "step-2", timeout=30)

    # The engine dies: the rollout turns Degraded, with a Warning event.
    engine.kill()
    st = wait("Degraded", lambda: (s := status(cluster, ns, name)).get("phase") == "Degraded" and s, timeout=30)
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "EngineUnreachable")
    assert st["makespanSeconds"] == pytest.approx(fin["makespan_s"], abs=5e-4), "last figures are kept"
    events = cluster.get("events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]
    assert any(e["reason"] == "Degraded" and e["type"] == "Warning" for e in events)


def test_multiplexing_change_reaches_engine_without_restart(cluster, live, wait):
    name, ns, engine = live["name"], live["ns"], live["engine"]
    wait("Running", lambda: status(cluster, ns, name).get("phase") == "Running", timeout=30)
    pod_uid = live["pod"]["metadata"]["uid"]
    sts_gen = cluster.get("statefulset", name, "-n", ns)["metadata"]["generation"]
    assert http(f"{engine.url}/control")["activation"] == "auto"

    cluster.kubectl("patch", "pdrollout", name, "-n", ns, "--type=merge", "-p", json.dumps(
        {"spec": {"multiplexing": {"activation": "on", "span": 2, "ordering": "global-enqueue"}}}))
    want = {"activation": "on", "span": 2, "prefill_budget_tokens": 32768, "ordering": "global-enqueue",
            "p_wait_bound_ms": None, "p_gather_ms": None, "p_burst_first": None}
    wait("the engine's /control to change", lambda: http(f"{engine.url}/control") == want, timeout=20,
         interval=0.2)
    # Same pod, same engine process, same StatefulSet template; the ConfigMap carries it for restarts.
    pod = cluster.get("pod", f"{name}-0", "-n", ns)
    assert pod["metadata"]["uid"] == pod_uid and engine.proc.poll() is None
    assert cluster.get("statefulset", name, "-n", ns)["metadata"]["generation"] == sts_gen
    cm = cluster.get("configmap", f"{name}-engine", "-n", ns)
    assert json.loads(cm["data"]["engine-config.json"])["control"] == want
    wait("status.control", lambda: status(cluster, ns, name).get("control", {}).get("span") == 2, timeout=20)

    # Without the rollout's admin token nobody else can change it: 401, nothing changes.
    with pytest.raises(urllib.error.HTTPError) as e:
        http(f"{engine.url}/control", {"activation": "off"}, method="PUT")
    assert e.value.code == 401
    with pytest.raises(urllib.error.HTTPError) as e:
        http(f"{engine.url}/pause_generation", {}, token="not-the-token")
    assert e.value.code == 401
    assert http(f"{engine.url}/control") == want

    # A holder of the token (a trainer given the Secret) changes it behind the operator's back: applied,
    # then the timer puts the spec back.
    token = admin_token(cluster, ns, name)
    assert http(f"{engine.url}/control", {"activation": "off"}, method="PUT", token=token)["activation"] == "off"
    wait("drift corrected", lambda: http(f"{engine.url}/control") == want, timeout=20, interval=0.2)
