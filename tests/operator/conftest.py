"""Fixtures for the operator tests: the locally built tools (helm, kubectl, promtool, hadolint), the real
control plane (session-scoped: built if needed, started on loopback, stopped at the end), and the
operator as a real process."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from real_cluster import real_cluster, real_namespace, real_operator  # noqa: F401  (fixtures: real nodes)

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "e2e" / "cluster"


def _versions() -> dict[str, str]:
    out = subprocess.run(["bash", "-c", f"set -a; source {CLUSTER}/versions.sh; env"], capture_output=True, text=True,
                         check=True).stdout
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return {k: env[k] for k in ("K8S_BIN", "ETCD_BIN", "HELM_BIN", "CLUSTER_PATH", "GANG_SCHEDULER",
                                "PODGROUP_CRD")}


@pytest.fixture(scope="session")
def tools() -> dict[str, str]:
    """Paths of helm, kubectl, promtool, hadolint. Builds the control plane once (cached by version)."""
    r = subprocess.run(["bash", str(CLUSTER / "build.sh")], capture_output=True, text=True, timeout=2400)
    if r.returncode:
        pytest.fail(f"e2e/cluster/build.sh failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    v = _versions()
    paths = {"helm": f"{v['HELM_BIN']}/helm", "kubectl": f"{v['K8S_BIN']}/kubectl",
             "promtool": shutil.which("promtool"), "hadolint": shutil.which("hadolint"),
             "PATH": f"{v['CLUSTER_PATH']}:{os.environ['PATH']}", "gang-scheduler": v["GANG_SCHEDULER"],
             "podgroup-crd": v["PODGROUP_CRD"]}
    return paths


@dataclass
class Cluster:
    dir: Path
    kubeconfig: Path
    tools: dict
    env: dict = field(default_factory=dict)

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 60) -> subprocess.CompletedProcess:
        r = subprocess.run([self.tools["kubectl"], *args], capture_output=True, text=True, env=self.env,
                           input=input, timeout=timeout)
        if check and r.returncode:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({r.returncode}):\n{r.stderr}{r.stdout}")
        return r

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([self.tools["helm"], *args], capture_output=True, text=True, env=self.env, timeout=180)
        if check and r.returncode:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{r.stderr}{r.stdout}")
        return r


def wait_for(what: str, fn, timeout: float = 60, interval: float = 0.5):
    """Poll fn() until it returns something truthy; fail naming `what` and the last value seen."""
    end, last = time.monotonic() + timeout, None
    while time.monotonic() < end:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; last seen: {last!r}")


@pytest.fixture(scope="session")
def cluster(tools) -> Cluster:
    d = Path(tempfile.mkdtemp(prefix="pdrollout-cluster-"))
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(CLUSTER / "start.sh"), str(d)], capture_output=True, text=True, timeout=600)
    if r.returncode:
        subprocess.run(["bash", str(CLUSTER / "stop.sh"), str(d)], capture_output=True)
        pytest.fail(f"e2e/cluster/start.sh failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    print(f"\n[cluster] control plane up in {time.monotonic() - t0:.1f}s at {d}", file=sys.stderr)
    env = {**os.environ, "KUBECONFIG": str(d / "kubeconfig"), "PATH": tools["PATH"],
           "HELM_CACHE_HOME": str(d / "helm-cache"), "HELM_CONFIG_HOME": str(d / "helm-config"),
           "HELM_DATA_HOME": str(d / "helm-data")}
    c = Cluster(dir=d, kubeconfig=d / "kubeconfig", tools=tools, env=env)
    yield c
    subprocess.run(["bash", str(CLUSTER / "stop.sh"), str(d)], capture_output=True, timeout=120)
    if os.environ.get("PDROLLOUT_KEEP_CLUSTER"):  # logs for debugging
        print(f"[cluster] kept {d}", file=sys.stderr)
    else:
        shutil.rmtree(d, ignore_errors=True)


@dataclass
class Operator:
    """The operator as a real process (`python -m pdrollout.operator`), killable and restartable."""
    env: dict
    log: Path
    proc: subprocess.Popen | None = None

    def start(self, script: Path | None = None, **extra_env: str) -> "Operator":
        """`script`: a test wrapper of the operator's entry point (e.g. tests/slow_operator.py)."""
        assert self.proc is None or self.proc.poll() is not None, "operator already running"
        self._fh = open(self.log, "ab")
        cmd = [str(script)] if script else ["-m", "pdrollout.operator"]
        self.proc = subprocess.Popen([sys.executable, *cmd, "--verbose"],
                                     env={**self.env, **extra_env}, stdout=self._fh, stderr=subprocess.STDOUT,
                                     cwd=ROOT)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
        if self.proc:
            self._fh.close()
        self.proc = None

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


def sa_kubeconfig(cluster: Cluster, namespace: str, sa: str, out: Path) -> Path:
    """A kubeconfig that authenticates as a ServiceAccount (a TokenRequest), so the operator runs with
    exactly the chart's RBAC."""
    token = cluster.kubectl("create", "token", sa, "-n", namespace, "--duration=2h").stdout.strip()
    cfg = json.loads(cluster.kubectl("config", "view", "--raw", "-o", "json").stdout)
    server = cfg["clusters"][0]["cluster"]["server"]
    ca = cfg["clusters"][0]["cluster"]["certificate-authority"]
    out.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server, "certificate-authority": ca}}],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": sa}}],
        "current-context": "c"}))
    return out


@pytest.fixture(scope="session")
def wait():
    return wait_for


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the item (item.rep_call), so a fixture can tell a failed test."""
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


from chart_install import OPERATOR_SA, RELEASE, SYSTEM_NS, token_key  # noqa: E402


@pytest.fixture(scope="session")
def installed(cluster) -> dict:
    """`helm install` of the chart (CRD, RBAC, operator Deployment, dashboard) into pdrollout-system."""
    # Cluster-wide (opt-in): every test makes its own namespace.
    cluster.helm("install", RELEASE, str(ROOT / "charts" / "pdrollout-operator"), "--namespace", SYSTEM_NS,
                 "--create-namespace", "--set", "rbac.clusterWide=true", "--wait", "--timeout", "120s")
    cluster.kubectl("wait", "--for=condition=Established", "crd/pdrollouts.pdrollout.io", "--timeout=60s")
    return {"release": RELEASE, "namespace": SYSTEM_NS, "serviceaccount": OPERATOR_SA}


@pytest.fixture(scope="session")
def operator(cluster, installed, tmp_path_factory) -> Operator:
    """The operator process, authenticated as the chart's ServiceAccount (so RBAC is exercised), polling
    every second. Tests that kill it must leave it running again."""
    d = tmp_path_factory.mktemp("operator")
    kc = sa_kubeconfig(cluster, SYSTEM_NS, OPERATOR_SA, d / "kubeconfig")
    # The chart's token key, as its Deployment mounts it.
    (d / "token-key").write_bytes(token_key(cluster))
    env = {**cluster.env, "KUBECONFIG": str(kc), "PDROLLOUT_OPERATOR_POLL_S": "1",
           "PDROLLOUT_OPERATOR_RESTART_BACKOFF_S": "15", "PDROLLOUT_OPERATOR_NAMESPACE": SYSTEM_NS,
           "PDROLLOUT_OPERATOR_TOKEN_KEY_FILE": str(d / "token-key"),
           "PDROLLOUT_OPERATOR_METRICS_ADDRESS": f"127.0.0.1:{free_port()}"}
    op = Operator(env=env, log=d / "operator.log").start()
    yield op
    op.kill(signal.SIGTERM)
    print(f"\n[operator] log tail:\n{op.logs()[-3000:]}", file=sys.stderr)


@pytest.fixture
def namespace(cluster, request) -> str:
    """A fresh namespace per test; deleted afterwards, waiting for its pods so GPU nodes are free again."""
    ns = "t-" + request.node.name.lower().replace("_", "-")[:40].strip("-[]")
    cluster.kubectl("create", "namespace", ns)
    models_claim(cluster, ns)
    yield ns
    # kubectl's own --timeout must end before the subprocess timeout, so a slow finalizer reads as rc != 0.
    cluster.kubectl("delete", "pdrollouts", "--all", "-n", ns, "--wait=true", "--timeout=60s", check=False,
                    timeout=90)
    cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    cluster.kubectl("delete", "pv", f"models-{ns}", "--wait=false", check=False)
    wait_for(f"pods of {ns} to go", lambda: not cluster.get("pods", "-n", ns)["items"], timeout=60)


def models_claim(cluster, ns: str) -> None:
    """The GPU examples' precondition ("create it first"): a PVC `models`, bound here to a hostPath PV
    of its own so the scheduler places the pods (fake nodes run no containers: nothing is read from it)."""
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"models-{ns}"},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                   "hostPath": {"path": "/models"}, "claimRef": {"namespace": ns, "name": "models"}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models", "namespace": ns},
           "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": f"models-{ns}",
                    "resources": {"requests": {"storage": "1Gi"}}}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [pv, pvc]}))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("model") / "tiny"
    r = subprocess.run([sys.executable, "-m", "pdrollout.engine.cli", "checkpoint", "--config", "tiny",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    if r.returncode:
        pytest.fail(f"`pdrollout checkpoint --config tiny` failed (the engine's CLI):\n{r.stderr[-3000:]}")
    return out


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def port() -> int:
    return free_port()
