"""Fixtures and helpers for tests against the real-node cluster (e2e/cluster/start.sh DIR --real-nodes 2):
real kubelets and containerd, images built here, the whole cluster inside network namespaces.

Every address of that cluster exists only inside its namespaces, so each command runs in one of them
(`RealCluster.run`, like e2e/cluster/in.sh): the control plane's by default, a node's with node=I (where
kube-proxy makes Service IPs work). tests/operator/conftest.py imports the fixtures from here."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from procs import alive

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "e2e" / "cluster"
REAL_RELEASE, REAL_SYSTEM_NS = "pdr", "pdrollout-system"


def _env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            out[k] = v.strip('"')
    return out


def _free_disk() -> str:
    cache = os.environ.get("PDROLLOUT_CACHE") or os.path.expanduser("~/.cache/pdrollout")
    return f"{shutil.disk_usage(cache if os.path.isdir(cache) else '/').free / 1e9:.1f} GB free on the cache's disk"


@dataclass
class RealCluster:
    dir: Path
    info: dict          # DIR/cluster.env: namespaces, node names and IPs, image references
    path: str           # PATH with the cluster's tools first

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    @property
    def nodes(self) -> list[str]:
        return self.info["NODE_NAMES"].split()

    @property
    def node_ips(self) -> list[str]:
        return self.info["NODE_IPS"].split()

    def netns(self, node: int | None = None) -> str:
        return self.info["NETNS_CP"] if node is None else self.info["NETNS_NODES"].split()[node]

    def run(self, *cmd: str, node: int | None = None, check: bool = True, input: str | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
        """Run CMD inside the cluster's network (the control plane's namespace, or node I's)."""
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PATH": self.path,
               "HELM_CACHE_HOME": str(self.dir / "helm-cache"), "HELM_CONFIG_HOME": str(self.dir / "helm-config"),
               "HELM_DATA_HOME": str(self.dir / "helm-data")}
        r = subprocess.run(["nsenter", f"--net=/run/netns/{self.netns(node)}", *cmd], capture_output=True,
                           text=True, env=env, input=input, timeout=timeout)
        if check and r.returncode:
            raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}) in {self.netns(node)}:\n"
                                 f"{r.stderr[-4000:]}{r.stdout[-2000:]}")
        return r

    def kubectl(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.run("kubectl", *args, **kw)

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def helm(self, *args: str, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("timeout", 300)
        return self.run("helm", *args, **kw)

    def http(self, url: str, *, node: int | None = None, method: str = "GET", body: str | None = None,
             timeout: float = 10) -> tuple[int, str]:
        """(status, body) of one HTTP request made from inside the cluster's network; status 0 when
        nothing answered, with curl's own error as the body."""
        cmd = ["curl", "-sS", "-m", str(timeout), "-X", method, "-o", "-", "-w", "\n%{http_code}", url]
        if body is not None:
            cmd += ["-H", "Content-Type: application/json", "--data-binary", "@-"]
        r = self.run(*cmd, node=node, check=False, input=body, timeout=timeout + 10)
        text, _, code = r.stdout.rpartition("\n")
        if not int(code or 0):
            return 0, f"curl exit {r.returncode}: {r.stderr.strip()}"
        return int(code), text

    def logs(self) -> str:
        """Tails of the cluster's component logs, for a failure message."""
        out = []
        for f in sorted((self.dir / "logs").glob("*.log")):
            out.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(out)


def _script(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=timeout)


def _recorded_alive(pid_file: Path) -> bool:
    text = pid_file.read_text().strip()
    return text.isdigit() and alive(int(text))


def sweep_dead_clusters(parent: Path) -> list[Path]:
    """Clean up real-node clusters whose test run was killed (no finalizer ran): every process they
    recorded is gone, but their mounts (over the node image store's snapshots) and namespaces stay
    until stop.sh removes them. A cluster with any recorded process alive belongs to a live run."""
    swept = []
    for d in sorted(parent.glob("pdr-real-*")):
        if not (d / "cluster.env").exists() or any(_recorded_alive(f) for f in (d / "pids").glob("*.pid")):
            continue
        _script(str(CLUSTER / "stop.sh"), str(d), timeout=300)
        shutil.rmtree(d, ignore_errors=True)
        swept.append(d)
    return swept


@pytest.fixture(scope="session")
def real_cluster(tools) -> RealCluster:
    """Two real nodes (build, Debian packages and images cached; a fresh machine builds them once).
    Fails, never skips, when this machine cannot run them, with the reason."""
    if os.environ.get("PDROLLOUT_REAL_CLUSTER"):  # a cluster already up (start.sh DIR --real-nodes 2): kept
        d = Path(os.environ["PDROLLOUT_REAL_CLUSTER"])
        if not (d / "cluster.env").exists():
            pytest.fail(f"PDROLLOUT_REAL_CLUSTER={d} has no cluster.env: not a real-node cluster")
        yield RealCluster(dir=d, info=_env_file(d / "cluster.env"), path=tools["PATH"])
        return
    if os.geteuid() != 0:
        pytest.fail("the real-node cluster needs root (network namespaces, containerd, mounts); "
                    "run the tests as root, as CI does")
    for step, timeout in (("node-deps.sh", 600), ("images.sh", 1800)):
        t0 = time.monotonic()
        r = _script(str(CLUSTER / step), timeout=timeout)
        if r.returncode:
            pytest.fail(f"e2e/cluster/{step} failed ({_free_disk()}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
        print(f"\n[real-nodes] {step}: {time.monotonic() - t0:.1f}s", file=sys.stderr)
    for gone in sweep_dead_clusters(Path(tempfile.gettempdir())):
        print(f"[real-nodes] cleaned up {gone}: its test run was killed", file=sys.stderr)
    d = Path(tempfile.mkdtemp(prefix="pdr-real-"))
    t0 = time.monotonic()
    r = _script(str(CLUSTER / "start.sh"), str(d), "--real-nodes", "2", timeout=900)
    if r.returncode:
        _script(str(CLUSTER / "stop.sh"), str(d), timeout=300)
        # the reason first: the components' log tails after it run to pages
        reason = [ln for ln in r.stderr.splitlines() if ln.startswith("[cluster] failed:")]
        pytest.fail(f"start.sh --real-nodes 2 failed ({_free_disk()}): {' '.join(reason) or '(no reason printed)'}\n"
                    f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    print(f"[real-nodes] 2 nodes up in {time.monotonic() - t0:.1f}s at {d}", file=sys.stderr)
    c = RealCluster(dir=d, info=_env_file(d / "cluster.env"), path=tools["PATH"])
    yield c
    t0 = time.monotonic()
    r = _script(str(CLUSTER / "stop.sh"), str(d), timeout=300)
    print(f"\n[real-nodes] stopped in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    if os.environ.get("PDROLLOUT_KEEP_CLUSTER"):
        print(f"[real-nodes] kept {d}", file=sys.stderr)
    else:
        shutil.rmtree(d, ignore_errors=True)


def helm_install_operator(c: RealCluster, *extra: str) -> dict:
    """`helm install` of the chart with the operator image built here (never pulled), --wait: returns once
    the Deployment is available, i.e. its pod passed the readiness probe."""
    repo, tag = c.info["OPERATOR_IMAGE"].rsplit(":", 1)
    if not any("watchNamespaces" in e for e in extra):   # the tests use namespaces of their own
        extra = ("--set", "rbac.clusterWide=true", *extra)
    c.helm("install", REAL_RELEASE, str(ROOT / "charts" / "pdrollout-operator"), "--namespace", REAL_SYSTEM_NS,
           "--create-namespace", "--set", f"image.repository={repo}", "--set", f"image.tag={tag}",
           "--set", "image.pullPolicy=Never", "--set", "operator.pollSeconds=2", *extra,
           "--wait", "--timeout", "180s")
    return {"release": REAL_RELEASE, "namespace": REAL_SYSTEM_NS}


@pytest.fixture(scope="session")
def real_operator(real_cluster) -> dict:
    """The chart installed on the real nodes: its operator runs as a pod with its ServiceAccount and RBAC.
    Torn down (if a test has not already uninstalled it) at the end of the session."""
    info = helm_install_operator(real_cluster)
    yield info
    real_cluster.helm("uninstall", REAL_RELEASE, "-n", REAL_SYSTEM_NS, "--wait", check=False)


@pytest.fixture
def real_namespace(real_cluster, request) -> str:
    """A fresh namespace per test on the real nodes; deleted afterwards, waiting for its pods to go."""
    ns = "r-" + request.node.name.lower().replace("_", "-")[:40].strip("-[]")
    real_cluster.kubectl("create", "namespace", ns)
    yield ns
    real_cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=90s", check=False, timeout=120)
