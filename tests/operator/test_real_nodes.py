"""The chart and the engine on real nodes: two kubelets with Debian's containerd and runc, images built
here, everything inside the cluster's network namespaces (e2e/cluster/start.sh DIR --real-nodes 2).

What kwok cannot show: the operator pod really starts from its image with the chart's ServiceAccount and
passes its readiness probe; an engine container runs `pdrollout serve` on the CPU and answers on its pod
IP, through a Service IP (kube-proxy) and a DNS name (CoreDNS); `kubectl logs`/`exec` reach the kubelets;
and deleting everything leaves nothing behind, on the API server nor in the nodes' runtimes."""
from __future__ import annotations

import json
import subprocess
import time

import pytest
from real_cluster import REAL_RELEASE, REAL_SYSTEM_NS, RealCluster, helm_install_operator

pytestmark = [pytest.mark.cluster, pytest.mark.real_nodes]

ENGINE_PORT = 30000


def _ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def _operator_pods(c: RealCluster) -> list[dict]:
    return c.get("pods", "-n", REAL_SYSTEM_NS, "-l", "app.kubernetes.io/name=pdrollout-operator")["items"]


def _engine_manifest(c: RealCluster, name: str, ns: str, node: str | None = None) -> str:
    """A plain engine Pod and its Service (what the operator's pods run, without the operator)."""
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": name}},
        "spec": {
            **({"nodeName": node} if node else {}),
            "containers": [{
                "name": "engine", "image": c.info["ENGINE_IMAGE"], "imagePullPolicy": "Never",
                "command": ["pdrollout"],
                "args": ["serve", "--model", c.info["ENGINE_MODEL"], "--device", "cpu", "--host", "0.0.0.0",
                         "--port", str(ENGINE_PORT)],
                "ports": [{"name": "http", "containerPort": ENGINE_PORT}],
                "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 2},
                "resources": {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"memory": "3Gi"}},
            }],
            "terminationGracePeriodSeconds": 5,
        },
    }
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
           "spec": {"selector": {"app": name}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [pod, svc]})


def test_nodes_are_real_kubelets(real_cluster):
    """Two Ready nodes registered by kubelets of the control plane's version, on containerd, with node
    addresses that exist only inside the cluster's namespaces."""
    nodes = {n["metadata"]["name"]: n for n in real_cluster.get("nodes")["items"]}
    assert sorted(nodes) == real_cluster.nodes == ["node-0", "node-1"]
    version = real_cluster.kubectl("version", "-o", "json").stdout
    server = json.loads(version)["serverVersion"]["gitVersion"]
    for name, ip in zip(real_cluster.nodes, real_cluster.node_ips):
        n = nodes[name]
        assert _ready(n), n["status"]["conditions"]
        info = n["status"]["nodeInfo"]
        assert info["kubeletVersion"] == server, info
        assert info["containerRuntimeVersion"].startswith("containerd://1."), info
        assert {"type": "InternalIP", "address": ip} in n["status"]["addresses"]
        assert "kwok.x-k8s.io/node" not in n["metadata"].get("annotations", {})
        # The address lives in that node's namespace, where its kubelet serves (10250, TLS).
        i = real_cluster.nodes.index(name)
        assert f" {ip}/" in real_cluster.run("ip", "-o", "addr", node=i).stdout
        # Its serving certificate is the cluster CA's, for that IP; it refuses an anonymous caller.
        code = real_cluster.run("curl", "-s", "--cacert", str(real_cluster.dir / "certs" / "ca.crt"), "-o",
                                "/dev/null", "-w", "%{http_code}", f"https://{ip}:10250/healthz", node=i,
                                check=False).stdout
        assert code == "401", code
    # The node addresses are not this machine's, and the cluster's namespaces lead nowhere else: the
    # control plane's holds only its bridge and the veths to the nodes, and has no default route.
    host = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    assert not any(f" {ip}/" in host for ip in real_cluster.node_ips)
    links = {line.split(":")[1].strip().split("@")[0]
             for line in real_cluster.run("ip", "-o", "link").stdout.splitlines()}
    assert links == {"lo", "pdr0", "n0", "n1"}, links
    assert "default" not in real_cluster.run("ip", "route").stdout
    for i in range(2):
        assert real_cluster.run("ip", "route", "show", "default", node=i).stdout.split()[:3] == \
            ["default", "via", "10.250.0.1"]


def test_chart_operator_pod_ready(real_cluster, real_operator):
    """`helm install --wait` returned, so the Deployment is available; its one pod runs the image built
    here as the chart's ServiceAccount, passes its readiness probe, and answers kopf's health endpoint
    on its pod IP; `kubectl logs` and `kubectl exec` go through the kubelet."""
    pods = _operator_pods(real_cluster)
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    pod = pods[0]
    spec, status = pod["spec"], pod["status"]
    assert spec["serviceAccountName"] == f"{REAL_RELEASE}-pdrollout-operator"
    assert spec["nodeName"] in real_cluster.nodes
    (container,) = spec["containers"]
    assert container["image"] == real_cluster.info["OPERATOR_IMAGE"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert status["phase"] == "Running" and _ready(pod)
    (cs,) = status["containerStatuses"]
    assert cs["ready"] and cs["restartCount"] == 0 and "running" in cs["state"], cs
    # The pod IP comes from its node's CNI bridge, and the probe's endpoint answers there.
    node_idx = real_cluster.nodes.index(spec["nodeName"])
    assert status["podIP"].startswith(f"10.244.{node_idx}."), status["podIP"]
    code, body = real_cluster.http(f"http://{status['podIP']}:8080/healthz")
    assert code == 200, (code, body)

    name = pod["metadata"]["name"]
    logs = real_cluster.kubectl("logs", "-n", REAL_SYSTEM_NS, name).stdout
    # kopf logged in with the ServiceAccount's token, and no request was refused.
    assert "Initial authentication has finished" in logs and "Forbidden" not in logs, logs[-3000:]
    who = real_cluster.kubectl("exec", "-n", REAL_SYSTEM_NS, name, "--", "python3", "-c",
                               "import os; print(os.getuid(), open('/var/run/secrets/kubernetes.io/"
                               "serviceaccount/namespace').read())").stdout.split()
    assert who == ["65532", REAL_SYSTEM_NS]


def test_operator_reads_the_api_as_its_serviceaccount(real_cluster, real_operator):
    """The operator's in-cluster credentials reach the API server through the `kubernetes` Service IP
    (kube-proxy on the operator's node) and its RBAC is what the chart grants: pdrollouts yes, secrets no."""
    name = _operator_pods(real_cluster)[0]["metadata"]["name"]
    probe = ("from kubernetes import client, config\n"
             "config.load_incluster_config()\n"
             "c = client.ApiClient()\n"
             "host = c.configuration.host\n"
             "api = client.CustomObjectsApi(c)\n"
             "n = len(api.list_cluster_custom_object('pdrollout.io', 'v1alpha1', 'pdrollouts')['items'])\n"
             "try:\n"
             "    client.CoreV1Api(c).list_namespaced_secret('default'); s = 'allowed'\n"
             "except client.exceptions.ApiException as e:\n"
             "    s = e.status\n"
             "print(host, n, s)\n")
    out = real_cluster.kubectl("exec", "-n", REAL_SYSTEM_NS, name, "--", "python3", "-c", probe).stdout.split()
    assert out == ["https://10.96.0.1:443", "0", "403"], out


def test_engine_pod_serves_on_cpu(real_cluster, real_namespace):
    """The CPU engine image runs `pdrollout serve` on the tiny model baked into it: Ready by its /health
    probe, answering /health and a generation on the pod IP, by Service IP from the other node, and by
    its DNS name from inside another container; its log is readable with `kubectl logs`."""
    c, ns = real_cluster, real_namespace
    c.kubectl("apply", "-f", "-", input=_engine_manifest(c, "engine", ns, node="node-0"))
    c.kubectl("wait", "--for=condition=Ready", "pod/engine", "-n", ns, "--timeout=240s", timeout=260)
    pod = c.get("pod", "engine", "-n", ns)
    ip = pod["status"]["podIP"]
    assert ip.startswith("10.244.0."), ip

    code, body = c.http(f"http://{ip}:{ENGINE_PORT}/health")
    assert code == 200 and json.loads(body)["status"] == "ok", (code, body)
    req = json.dumps({"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    code, body = c.http(f"http://{ip}:{ENGINE_PORT}/generate", method="POST", body=req, timeout=60)
    assert code == 200, (code, body)
    out = json.loads(body)
    assert out["meta_info"]["completion_tokens"] == 4, out

    # A Service IP is answered on the nodes, where kube-proxy put its rules (node-1: across nodes).
    cluster_ip = c.get("service", "engine", "-n", ns)["spec"]["clusterIP"]
    code, body = c.http(f"http://{cluster_ip}/health", node=1)
    assert code == 200, (code, body)

    # From inside a container (the operator's engine peers resolve each other like this): CoreDNS.
    fqdn = f"engine.{ns}.svc.cluster.local"
    got = c.kubectl("exec", "-n", ns, "engine", "--", "python3", "-c",
                    f"import socket, urllib.request; print(socket.gethostbyname('{fqdn}'), "
                    f"urllib.request.urlopen('http://{fqdn}/health', timeout=10).status)").stdout.split()
    assert got == [cluster_ip, "200"], got

    logs = c.kubectl("logs", "-n", ns, "engine").stdout
    assert f"pdrollout serve: ready on http://0.0.0.0:{ENGINE_PORT}" in logs, logs[-2000:]


def test_operator_pod_template_runs_on_a_real_kubelet(real_cluster, real_namespace):
    """The objects the operator's builders make for a one-pod rollout, applied as they are except for the
    two GPU-only bits (until the CR has `device: cpu`): the engine starts from the command, args, env and
    volumes of the template, reads its config from the mounted ConfigMap, turns Ready through the
    template's readiness probe, and resolves rank 0's stable name to itself."""
    from pdrollout.operator import builders
    from pdrollout.operator.models import PDRolloutSpec

    c, ns = real_cluster, real_namespace
    spec = PDRolloutSpec.model_validate({
        "image": c.info["ENGINE_IMAGE"], "model": {"path": c.info["ENGINE_MODEL"], "dtype": "float32"},
        "topology": {"nodes": 1, "gpusPerNode": 1, "expertParallel": 1, "attentionDataParallel": 1},
        "multiplexing": {"ordering": "global-enqueue", "span": 2},
        "resources": {"cpu": "500m", "memory": "3Gi", "sharedMemory": "256Mi", "rdmaPerNode": 0}})
    objs = builders.desired_objects("tpl", ns, spec, "t" * 64, REAL_SYSTEM_NS)
    sts = objs[-1]
    assert sts["kind"] == "StatefulSet"
    (ctr,) = sts["spec"]["template"]["spec"]["containers"]
    for part in ("requests", "limits"):
        ctr["resources"][part].pop("nvidia.com/gpu")
    ctr["args"][ctr["args"].index("--device") + 1] = "cpu"
    c.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}))
    c.kubectl("rollout", "status", "statefulset/tpl", "-n", ns, "--timeout=240s", timeout=260)

    pod = c.get("pod", "tpl-0", "-n", ns)
    ip = pod["status"]["podIP"]
    env = dict(line.split("=", 1) for line in c.kubectl("exec", "-n", ns, "tpl-0", "--", "printenv").stdout.split())
    assert env["POD_IP"] == ip and env["POD_NAME"] == "tpl-0" and env["PDROLLOUT_NODE_RANK"] == "0", env
    code, body = c.http(f"http://{ip}:{spec.port}/control")
    assert code == 200, (code, body)
    control = json.loads(body)
    assert control["ordering"] == "global-enqueue" and control["span"] == 2, control
    shm = c.kubectl("exec", "-n", ns, "tpl-0", "--", "python3", "-c",
                    "import os, socket; s = os.statvfs('/dev/shm'); "
                    f"print(s.f_blocks * s.f_frsize >> 20, socket.gethostbyname('{env['PDROLLOUT_MASTER_ADDR']}'))")
    assert shm.stdout.split() == ["256", ip], shm.stdout


PEER_SCRIPT = """
import os, socket, sys, time
me, ns = os.environ["HOSTNAME"], os.environ["NS"]
srv = socket.create_server(("0.0.0.0", 29500))
if me.endswith("-1"):
    peer = f"grp-0.grp.{ns}.svc.cluster.local"
    for _ in range(240):
        try:
            conn = socket.create_connection((peer, 29500), timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    conn.sendall(b"hello")
    print("connected", socket.gethostbyname(peer), conn.recv(16).decode(), flush=True)
else:
    conn, addr = srv.accept()
    conn.sendall(b"ack:" + conn.recv(16))
    print("accepted", addr[0], flush=True)
time.sleep(3600)
"""


def _group(c: RealCluster, ns: str, command: list[str]) -> str:
    """What the operator creates per rollout, made directly: a ConfigMap, a headless Service that
    publishes not-ready pods, and a 2-pod StatefulSet placed one per node by anti-affinity."""
    sts = {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": "grp", "namespace": ns},
        "spec": {"replicas": 2, "serviceName": "grp", "podManagementPolicy": "Parallel",
                 "selector": {"matchLabels": {"app": "grp"}},
                 "template": {"metadata": {"labels": {"app": "grp"}}, "spec": {
                     "containers": [{"name": "c", "image": c.info["ENGINE_IMAGE"], "imagePullPolicy": "Never",
                                     "command": command, "env": [{"name": "NS", "value": ns}]}],
                     "terminationGracePeriodSeconds": 1,
                     "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
                         "labelSelector": {"matchLabels": {"app": "grp"}},
                         "topologyKey": "kubernetes.io/hostname"}]}}}}}}
    objs = [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "grp", "namespace": ns},
             "data": {"k": "v"}},
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "grp", "namespace": ns},
             "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"app": "grp"},
                      "ports": [{"name": "dist", "port": 29500}]}}, sts]
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": objs})


def test_group_pods_reach_each_other_by_stable_name(real_cluster, real_namespace, wait):
    """The path a multi-node engine's rendezvous takes: pod 1 resolves pod 0's stable name
    (<sts>-0.<headless svc>.<ns>.svc.cluster.local, CoreDNS) and connects to it across nodes."""
    c, ns = real_cluster, real_namespace
    c.kubectl("apply", "-f", "-", input=_group(c, ns, ["python3", "-c", PEER_SCRIPT]))
    c.kubectl("rollout", "status", "statefulset/grp", "-n", ns, "--timeout=180s", timeout=200)
    pods = {p["metadata"]["name"]: p for p in c.get("pods", "-n", ns)["items"]}
    assert {pods["grp-0"]["spec"]["nodeName"], pods["grp-1"]["spec"]["nodeName"]} == {"node-0", "node-1"}
    ip0, ip1 = pods["grp-0"]["status"]["podIP"], pods["grp-1"]["status"]["podIP"]
    log1 = wait("grp-1 to reach grp-0", lambda: "connected" in (o := c.kubectl(
        "logs", "-n", ns, "grp-1", check=False).stdout) and o, timeout=120)
    assert log1.split() == ["connected", ip0, "ack:hello"], log1
    assert c.kubectl("logs", "-n", ns, "grp-0").stdout.split() == ["accepted", ip1]


def test_deletions_leave_nothing(real_cluster, real_namespace):
    """helm uninstall and namespace deletion: no pod, Service, ConfigMap or StatefulSet remains, and the
    nodes' containerd runs no container of them any more. Runs last: it uninstalls the chart."""
    c, ns = real_cluster, real_namespace
    if not c.helm("status", REAL_RELEASE, "-n", REAL_SYSTEM_NS, check=False).returncode == 0:
        helm_install_operator(c)
    c.kubectl("apply", "-f", "-", input=_group(c, ns, ["python3", "-c", "import time; time.sleep(3600)"]))
    c.kubectl("rollout", "status", "statefulset/grp", "-n", ns, "--timeout=180s", timeout=200)
    pods = c.get("pods", "-n", ns)["items"]
    assert sorted(p["spec"]["nodeName"] for p in pods) == ["node-0", "node-1"]  # anti-affinity, 2 nodes
    running = _containers_on_nodes(c)
    assert sum(1 for name in running if name == "c") == 2, running

    c.helm("uninstall", REAL_RELEASE, "-n", REAL_SYSTEM_NS, "--wait", "--timeout", "120s")
    c.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=120s", timeout=150)

    def left() -> list[str]:
        # A namespace's own kube-root-ca.crt goes with the namespace; nothing else may remain.
        return [f"{where}/{o}" for where in (ns, REAL_SYSTEM_NS)
                for o in c.kubectl("get", "pods,services,configmaps,statefulsets", "-n", where, "-o", "name",
                                   check=False).stdout.split() if o != "configmap/kube-root-ca.crt"]
    # The operator's pod goes by garbage collection after its Deployment, so it may take a moment.
    assert _settles(left, timeout=90) == []
    assert c.kubectl("get", "clusterrole", f"{REAL_RELEASE}-pdrollout-operator", check=False).returncode != 0
    # The kubelets stopped every container of those pods (the runtime's view, not the API's).
    assert _settles(lambda: _containers_on_nodes(c), timeout=60) == []


def _settles(fn, timeout: float) -> list:
    """fn() once it returns an empty list, else its last value after `timeout` seconds."""
    end = time.monotonic() + timeout
    while (out := fn()) and time.monotonic() < end:
        time.sleep(0.5)
    return out


def _containers_on_nodes(c: RealCluster) -> list[str]:
    """Names of the containers that the nodes' containerd run (pause sandboxes left out)."""
    names = []
    for i in range(len(c.nodes)):
        sock = c.dir / "nodes" / f"node-{i}" / "containerd.sock"
        r = c.run("ctr", "--address", str(sock), "-n", "k8s.io", "containers", "ls", "--quiet")
        for cid in r.stdout.split():
            info = json.loads(c.run("ctr", "--address", str(sock), "-n", "k8s.io", "containers", "info",
                                    cid).stdout)
            labels = info.get("Labels") or {}
            if labels.get("io.cri-containerd.kind") == "container":
                task = c.run("ctr", "--address", str(sock), "-n", "k8s.io", "tasks", "ls", check=False).stdout
                if cid in task and "RUNNING" in task.split(cid, 1)[1].split("\n", 1)[0]:
                    names.append(labels.get("io.kubernetes.container.name", "?"))
    return names
