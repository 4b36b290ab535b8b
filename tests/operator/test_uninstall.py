"""The chart's pre-delete hook on the real API server: with the operator gone, kopf's finalizer would hold
every PDRollout (and its namespace) forever; the hook (the Job's own command, run as a process with the
hook's ServiceAccount: kwok runs no containers) scales the operator to 0 and releases the finalizers, so
deleting the namespace then completes and leaves no pod."""
import base64
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdrollout-operator"
FINALIZER = "pdrollout.io/operator"


def test_pre_delete_hook_releases_every_rollout(cluster, installed, operator, namespace, kubeconfig_for, tmp_path,
                                                wait):
    # The session's operator watches every namespace: stopped here, so only this release's acts.
    operator.kill(signal.SIGTERM)
    try:
        _uninstall_releases(cluster, namespace, kubeconfig_for, tmp_path, wait)
    finally:
        operator.start()


def _uninstall_releases(cluster, namespace, kubeconfig_for, tmp_path, wait):
    ns, release = namespace, "un"
    values = ["--set", f"watchNamespaces={{{ns}}}", "--set", "fullnameOverride=un-op",
              "--set", "operator.leaderElection=false"]
    cluster.helm("install", release, str(CHART), "-n", ns, "--skip-crds", *values)
    rendered = subprocess.run([cluster.tools["helm"], "template", release, str(CHART), "-n", ns, "--kube-version",
                               "1.34.0", *values], capture_output=True, text=True, timeout=120, env=cluster.env)
    assert rendered.returncode == 0, rendered.stderr
    hooks = [d for d in yaml.safe_load_all(rendered.stdout)
             if d and (d["metadata"].get("annotations") or {}).get("helm.sh/hook") == "pre-delete"]

    # This release's operator, as a process with its ServiceAccount, watching the namespace.
    key = cluster.get("secret", "un-op-token-key", "-n", ns)["data"]["key"]
    (tmp_path / "key").write_bytes(base64.b64decode(key))
    env = {**cluster.env, "KUBECONFIG": str(kubeconfig_for(ns, "un-op", tmp_path / "op.kubeconfig")),
           "PDROLLOUT_OPERATOR_NAMESPACE": ns, "PDROLLOUT_OPERATOR_TOKEN_KEY_FILE": str(tmp_path / "key"),
           "PDROLLOUT_OPERATOR_POLL_S": "1"}
    log = open(tmp_path / "operator.log", "wb")
    op = subprocess.Popen([sys.executable, "-m", "pdrollout.operator", "--namespace", ns], env=env, stdout=log,
                          stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
        name = doc["metadata"]["name"]
        wait("kopf's finalizer and the pod", lambda: FINALIZER in (cluster.get("pdrollout", name, "-n", ns)[
            "metadata"].get("finalizers") or []) and cluster.get("pods", "-n", ns, "-l",
                                                                  f"pdrollout.io/rollout={name}")["items"], timeout=60)
    finally:
        op.send_signal(signal.SIGTERM)   # the chart's operator pod going away, as the hook's scale-down does
        op.wait(timeout=60)
        log.close()

    # Without the hook nothing releases it: the deletion waits on the finalizer.
    r = cluster.kubectl("delete", "pdrollout", name, "-n", ns, "--wait=true", "--timeout=5s", check=False)
    assert r.returncode != 0 and "timed out" in r.stderr, r.stderr
    assert FINALIZER in cluster.get("pdrollout", name, "-n", ns)["metadata"]["finalizers"]

    # The hook: its RBAC as helm would make it, then the Job's container command as the hook's account.
    for d in hooks:
        if d["kind"] != "Job":
            cluster.kubectl("apply", "-f", "-", input=json.dumps(d))
    (job,) = [d for d in hooks if d["kind"] == "Job"]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"][:3] == ["python", "-m", "pdrollout.operator.uninstall"]
    hook_env = {**cluster.env, "KUBECONFIG": str(kubeconfig_for(ns, job["spec"]["template"]["spec"]["serviceAccountName"],
                                                                tmp_path / "hook.kubeconfig"))}
    out = subprocess.run([sys.executable, *c["command"][1:], *c["args"]], env=hook_env, capture_output=True,
                         text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"operatorStopped": True,
                                                                "finalizersReleased": [f"{ns}/{name}"]}
    assert cluster.get("deployment", "un-op", "-n", ns)["spec"]["replicas"] == 0
    assert not cluster.get("pods", "-n", ns, "-l", "app.kubernetes.io/instance=un")["items"]

    # Now the deletion completes (the PDRollout already had its deletionTimestamp) and the garbage
    # collector takes the group's pods.
    wait("the PDRollout gone", lambda: cluster.kubectl("get", "pdrollout", name, "-n", ns,
                                                      check=False).returncode != 0, timeout=60)
    wait("the group's pods gone", lambda: not cluster.get("pods", "-n", ns, "-l", f"pdrollout.io/rollout={name}")[
        "items"], timeout=60)
    cluster.helm("uninstall", release, "-n", ns, "--no-hooks")
