"""Pure builders: exact objects and env from a spec, no cluster."""
import json
import os
import subprocess
import sys
from pathlib import Path

import kopf
import pytest
import yaml
from pydantic import ValidationError

from pdrollout.engine.protocol.config import EngineConfig
from pdrollout.engine.protocol import netenv
from pdrollout.engine.protocol.layout import resolve
from pdrollout.operator import builders
from pdrollout.operator.models import PDRolloutSpec

ROOT = Path(__file__).resolve().parents[2]


def spec_of(path: str) -> PDRolloutSpec:
    return PDRolloutSpec.model_validate(yaml.safe_load((ROOT / path).read_text())["spec"])


def env_map(env: list[dict]) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in env}


FIELD_ENV = {
    "PDROLLOUT_NODE_RANK": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}},
    "POD_NAME": {"fieldRef": {"fieldPath": "metadata.name"}},
    "POD_IP": {"fieldRef": {"fieldPath": "status.podIP"}},
    "PDROLLOUT_ROLLOUT_INFO": "/etc/pdrollout/rollout.json",
    "PDROLLOUT_ADMIN_TOKEN_FILE": "/var/run/secrets/pdrollout/token",
}


def test_two_node_ep16_adp8_env_is_exact():
    """The layout is in the mounted file; env holds only the pod's own values and what NCCL reads."""
    env = env_map(builders.engine_env("big", "rl", spec_of("examples/pdrollout-2node.yaml")))
    hcas = ",".join(f"mlx5_{i}:1" for i in range(8))
    assert env == {**FIELD_ENV, "NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": hcas, "NCCL_NVLS_ENABLE": "0"}


def test_deep_ep_env_is_exact():
    env = env_map(builders.engine_env("r", "ns", spec_of("examples/pdrollout.yaml")))
    assert env == {**FIELD_ENV, "NCCL_SOCKET_IFNAME": "eth0", "NCCL_NVLS_ENABLE": "0",
                   "NVSHMEM_IB_ENABLE_IBGDA": "0", "NVSHMEM_QP_DEPTH": "1024", "NVSHMEM_IBGDA_NUM_RC_PER_PE": "32",
                   "NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_MAX_TEAMS": "7",
                   "NVSHMEM_CUMEM_GRANULARITY": str(1 << 29), "NVSHMEM_DISABLE_P2P": "0",
                   "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "eth0",   # DeepEP's unique-id bootstrap
                   "PDROLLOUT_QP_RANGE_D": "0:16", "PDROLLOUT_QP_RANGE_P": "16:32"}


def test_cpu_env_has_no_network_settings():
    env = env_map(builders.engine_env("t", "ns", spec_of("examples/pdrollout-cpu.yaml")))
    # ...only the identity a uid without a passwd entry needs (torch calls getpass at import)
    assert env == {**FIELD_ENV, "USER": "pdrollout", "HOME": "/tmp"}


@pytest.mark.parametrize("s", [1, 8, 24])
def test_qp_ranges_split_phases_as_the_engine_reads_them(s):
    spec = PDRolloutSpec.model_validate({"image": "i", "model": {"path": "/m"}, "expertBackend": "deep_ep",
                                         "network": {"nvshmem": {"qpsPerRank": s}}})
    env = env_map(builders.engine_env("r", "ns", spec))
    assert env["PDROLLOUT_QP_RANGE_D"] == f"0:{s}" and env["PDROLLOUT_QP_RANGE_P"] == f"{s}:{2 * s}"
    assert env["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == str(2 * s)
    split = netenv.qp_split_from_env(env, local_experts=s)          # the DeepEP backend's own reading
    assert (split.decode, split.prefill) == (range(0, s), range(s, 2 * s))
    with pytest.raises(ValueError, match=f"holds {s} QPs, but the low-latency kernels use one per local expert"):
        netenv.qp_split_from_env(env, local_experts=s + 1)


def test_qp_ranges_that_contradict_are_named():
    with pytest.raises(ValueError, match="set both or neither"):
        netenv.qp_split_from_env({"PDROLLOUT_QP_RANGE_D": "0:8"}, 8)
    with pytest.raises(ValueError, match="must be \\[0, s\\) and \\[s, 2s\\)"):
        netenv.qp_split_from_env({"PDROLLOUT_QP_RANGE_D": "0:8", "PDROLLOUT_QP_RANGE_P": "9:17"}, 8)
    with pytest.raises(ValueError, match="NVSHMEM_IBGDA_NUM_RC_PER_PE=8 but the QP ranges need 16"):
        netenv.qp_split_from_env({"PDROLLOUT_QP_RANGE_D": "0:8", "PDROLLOUT_QP_RANGE_P": "8:16",
                                  "NVSHMEM_IBGDA_NUM_RC_PER_PE": "8"}, 8)
    assert netenv.qp_split_from_env({}, 8) == netenv.qp_split(8)   # not injected: the engine's own split


def test_ibgda_off_inside_a_node():
    one = spec_of("examples/pdrollout.yaml")
    assert env_map(builders.engine_env("r", "ns", one))["NVSHMEM_IB_ENABLE_IBGDA"] == "0"  # NVLink inside a node
    assert "NCCL_IB_HCA" not in env_map(builders.engine_env("r", "ns", one)), "no HCAs listed: none set"


@pytest.mark.parametrize("nodes,gpus,ep,adp,atp,etp", [
    (1, 8, 8, 2, 4, 1), (1, 8, 8, 8, 1, 1), (2, 8, 16, 8, 2, 1), (2, 8, 8, 16, 1, 2), (1, 4, 2, 1, 4, 2)])
def test_topology_arithmetic_reaches_the_engine(nodes, gpus, ep, adp, atp, etp, tmp_path):
    spec = PDRolloutSpec.model_validate({
        "image": "i", "model": {"path": "/m"}, "network": {"ibHCAs": ["mlx5_0"]},
        "topology": {"nodes": nodes, "gpusPerNode": gpus, "expertParallel": ep, "attentionDataParallel": adp}})
    info = builders.rollout_info("r", "ns", spec)
    assert info["attentionTP"] * info["attentionDataParallel"] == info["worldSize"] == nodes * gpus
    assert (info["attentionTP"], info["expertTP"]) == (atp, etp)
    path = tmp_path / "rollout.json"
    path.write_text(json.dumps(info))
    for node in range(nodes):   # what each pod's engine makes of the file and its own node rank
        layout = resolve(env={"PDROLLOUT_ROLLOUT_INFO": str(path), "PDROLLOUT_NODE_RANK": str(node)})
        assert (layout.world, layout.nnodes, layout.nproc_per_node, layout.adp, layout.ep) == \
            (nodes * gpus, nodes, gpus, adp, ep)
        assert (layout.topology.atp, layout.topology.etp) == (atp, etp)
        assert list(layout.local_ranks) == list(range(node * gpus, (node + 1) * gpus))
        assert layout.master_addr == "r-0.r.ns.svc.cluster.local" and layout.device == "cuda"


@pytest.mark.parametrize("example", ["examples/pdrollout.yaml", "examples/pdrollout-2node.yaml",
                                     "examples/pdrollout-cpu.yaml"])
def test_pod_command_is_what_the_engine_cli_accepts(example, tmp_path):
    """The container's args and env, parsed by the engine's own CLI: the whole group in every pod
    (this test would have caught pods that each started a one-GPU engine)."""
    from pdrollout.engine.cli import build_parser
    from pdrollout.engine.runtime.options import layout_from_args
    spec = spec_of(example)
    name, ns = "r", "ns"
    c = builders.statefulset(name, ns, spec)["spec"]["template"]["spec"]["containers"][0]
    files = builders.configmap(name, ns, spec)["data"]
    for key, text in files.items():
        (tmp_path / key).write_text(text)
    env = {e["name"]: e.get("value") for e in c["env"]}
    env["PDROLLOUT_ROLLOUT_INFO"] = str(tmp_path / "rollout.json")
    resolved = {**env, "POD_IP": "10.0.0.7", "PDROLLOUT_NODE_RANK": str(spec.topology.nodes - 1)}
    args = [a.replace("$(POD_IP)", resolved["POD_IP"]).replace(builders.CONFIG_DIR, str(tmp_path)) for a in c["args"]]
    assert c["command"] == ["pdrollout"]
    a = build_parser().parse_args(args)
    assert (a.command, a.host, a.port) == ("serve", "10.0.0.7", spec.port)
    import os
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update({k: v for k, v in resolved.items() if v is not None})
        layout = layout_from_args(a)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    t = spec.topology
    assert (layout.world, layout.nnodes, layout.node_rank, layout.nproc_per_node) == \
        (t.world_size, t.nodes, t.nodes - 1, t.gpus_per_node)
    assert (layout.adp, layout.ep, layout.device, layout.expert_backend) == \
        (t.attention_data_parallel, t.expert_parallel, spec.device, spec.expert_backend)
    EngineConfig.model_validate({"model": spec.model.path, "device": layout.device,
                                 **json.loads(files["engine-config.json"])})


def test_statefulset_one_pod_per_node_with_all_gpus():
    spec = spec_of("examples/pdrollout-2node.yaml")
    sts = builders.statefulset("big", "rl", spec)
    assert sts["spec"]["replicas"] == 2 and sts["spec"]["serviceName"] == "big"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"] == {"cpu": "64", "memory": "1Ti", "nvidia.com/gpu": "8", "rdma/ib": "8"}
    assert c["resources"]["requests"] == c["resources"]["limits"]
    assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "128Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # The group's own pods apart (one per node); other rollouts are kept off by the GPUs requested.
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchExpressions"] == [{"key": "pdrollout.io/rollout", "operator": "In",
                                                          "values": ["big"]}]
    assert "podAffinity" not in pod["affinity"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()


def test_no_rdma_requested_when_zero():
    spec = PDRolloutSpec.model_validate({"image": "i", "model": {"path": "/m"}, "resources": {"rdmaPerNode": 0}})
    limits = builders.statefulset("r", "ns", spec)["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "rdma/ib" not in limits and limits["nvidia.com/gpu"] == "8"


def test_cpu_pods_request_no_gpu_no_rdma_no_capabilities():
    pod = builders.statefulset("t", "ns", spec_of("examples/pdrollout-cpu.yaml"))["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"] == {"cpu": "2", "memory": "2Gi"}
    assert "tolerations" not in pod
    # Non-root, no capabilities, no privilege escalation, no API token.
    assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}, "runAsNonRoot": True,
                                      "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert pod["automountServiceAccountToken"] is False


def test_the_engine_is_not_pid_1_so_a_sigterm_always_ends_it():
    """The kernel drops a signal to a PID 1 without a handler for it: an engine deleted in its first
    seconds (before its handlers exist) ran its whole grace period on real kubelets, and joined the
    group's next start. With the pod's PID namespace shared, the pause container is PID 1."""
    for example in ("examples/pdrollout.yaml", "examples/pdrollout-cpu.yaml"):
        assert builders.pod_template("t", "ns", spec_of(example))["spec"]["shareProcessNamespace"] is True


def test_cuda_pods_keep_only_ipc_lock_and_no_api_token():
    pod = builders.statefulset("t", "ns", spec_of("examples/pdrollout.yaml"))["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["containers"][0]["securityContext"] == {"allowPrivilegeEscalation": False,
                                                        "capabilities": {"add": ["IPC_LOCK"]}}


def test_admin_token_secret_is_mounted_where_the_engine_reads_it():
    import base64
    sec = builders.admin_secret("r", "ns", "tok")
    assert sec["metadata"]["name"] == "r-admin" and base64.b64decode(sec["data"]["token"]) == b"tok"
    pod = builders.statefulset("r", "ns", spec_of("examples/pdrollout.yaml"))["spec"]["template"]["spec"]
    vol = next(v for v in pod["volumes"] if v["name"] == "admin")
    assert vol["secret"] == {"secretName": "r-admin", "defaultMode": 0o440}
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "admin"]
    token_file = env_map(pod["containers"][0]["env"])["PDROLLOUT_ADMIN_TOKEN_FILE"]
    assert token_file == f"{mount['mountPath']}/token" and mount["readOnly"]


def test_admin_tokens_are_per_rollout_and_stable():
    key = b"k" * 32
    t = builders.admin_token(key, "ns", "r", "uid-1")
    assert t == builders.admin_token(key, "ns", "r", "uid-1") and len(t) == 64
    assert len({t, builders.admin_token(key, "ns", "r", "uid-2"), builders.admin_token(key, "ns2", "r", "uid-1"),
                builders.admin_token(b"j" * 32, "ns", "r", "uid-1")}) == 4


def test_network_policy_admits_the_group_the_operator_and_the_namespace():
    spec = spec_of("examples/pdrollout.yaml")
    np = builders.network_policy("r", "ns", spec, "ops")
    assert np["spec"]["podSelector"] == {"matchLabels": {"pdrollout.io/rollout": "r"}}
    assert np["spec"]["policyTypes"] == ["Ingress"]
    group, http = np["spec"]["ingress"]
    assert group == {"from": [{"podSelector": {"matchLabels": {"pdrollout.io/rollout": "r"}}}]}  # every port
    assert http["ports"] == [{"protocol": "TCP", "port": 30000}]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
            "podSelector": {"matchLabels": {"pdrollout.io/component": "operator"}}} in http["from"]
    assert {"podSelector": {}} in http["from"]   # this namespace's clients


def test_network_policy_admits_declared_trainers_and_scrapers():
    """spec.access: trainer peers on every port (NCCL weight sync), their CIDRs as the engine's
    --admin-peers; the scraper's peers replace the metrics-access namespace label."""
    doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())["spec"]
    plain = spec_of("examples/pdrollout.yaml")
    assert "--admin-peers" not in builders.engine_args(plain)
    assert {"namespaceSelector": {"matchLabels": {"pdrollout.io/metrics-access": "true"}}} in \
        builders.network_policy("r", "ns", plain, "ops")["spec"]["ingress"][1]["from"]
    trainers = [{"ipBlock": {"cidr": "10.8.0.0/16", "except": ["10.8.9.0/24"]}}, {"ipBlock": {"cidr": "fd00::/64"}},
                {"namespaceSelector": {"matchLabels": {"team": "rl"}}, "podSelector": {"matchLabels": {"app": "trainer"}}}]
    scrapers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    spec = PDRolloutSpec.model_validate({**doc, "access": {"trainerPeers": trainers, "metricsPeers": scrapers}})
    np = builders.network_policy("r", "ns", spec, "ops")
    group, http, trainer = np["spec"]["ingress"]
    assert trainer == {"from": trainers}                 # no `ports`: every port, NCCL's ephemeral ones too
    assert http["from"][-1:] == scrapers and http["ports"] == [{"protocol": "TCP", "port": 30000}]
    assert {"namespaceSelector": {"matchLabels": {"pdrollout.io/metrics-access": "true"}}} not in http["from"]
    args = builders.engine_args(spec)
    assert args[args.index("--admin-peers") + 1] == "10.8.0.0/16,fd00::/64"
    # Selectors only: nothing for the engine (it sees addresses, not labels).
    spec = PDRolloutSpec.model_validate({**doc, "access": {"trainerPeers": trainers[2:]}})
    assert "--admin-peers" not in builders.engine_args(spec)


@pytest.mark.parametrize("peer, error", [
    ({"ipBlock": {"cidr": "10.8.0.0/33"}}, "'10.8.0.0/33' is not a CIDR network"),
    ({"ipBlock": {"cidr": "10.8.0.0/16"}, "podSelector": {}}, "a peer is an ipBlock or selectors, not both"),
    ({}, "a peer needs ipBlock, podSelector or namespaceSelector"),
])
def test_bad_trainer_peers_are_refused_naming_the_field(peer, error):
    doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())["spec"]
    with pytest.raises(ValidationError) as e:
        PDRolloutSpec.model_validate({**doc, "access": {"trainerPeers": [peer]}})
    assert error in str(e.value) and "access.trainerPeers.0" in str(e.value), str(e.value)


def test_multiplexing_is_not_in_the_pod_template():
    """A control change must never change the template (that would restart the pods)."""
    base = spec_of("examples/pdrollout.yaml")
    changed = base.model_copy(update={"multiplexing": base.multiplexing.model_copy(
        update={"activation": "on", "span": 3, "ordering": "global-enqueue"})})
    assert builders.statefulset("r", "ns", base) == builders.statefulset("r", "ns", changed)
    assert builders.configmap("r", "ns", base) != builders.configmap("r", "ns", changed)
    cfg = json.loads(builders.configmap("r", "ns", changed)["data"]["engine-config.json"])
    assert cfg["control"] == {"activation": "on", "span": 3, "prefill_budget_tokens": 32768,
                              "ordering": "global-enqueue", "p_wait_bound_ms": None, "p_gather_ms": None, "p_burst_first": None}


@pytest.mark.parametrize("start", [{"model": {"path": "/models/tiny", "dtype": "float32"}},
                                   {"speculative": {"method": "ngram", "k": 2}},
                                   {"speculative": {"method": "draft", "draftModel": "/models/draft"}}])
def test_a_start_time_engine_field_changes_the_pod_template(start):
    """dtype and speculation are read when an engine starts: a change must recreate the group (a new
    template hash), where a control change does not (test above)."""
    doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())["spec"]
    base, changed = PDRolloutSpec.model_validate(doc), PDRolloutSpec.model_validate({**doc, **start})
    assert builders.template_hash("r", "ns", base) != builders.template_hash("r", "ns", changed)
    assert builders.configmap("r", "ns", base) != builders.configmap("r", "ns", changed)


def test_speculation_reaches_the_engine_config(tmp_path):
    """spec.speculative becomes the EngineConfig fields `pdrollout serve --speculative` sets, and the
    engine accepts them against a checkpoint with an MTP head."""
    from conftest import tiny_config
    from pdrollout.engine.model.checkpoint import write_checkpoint
    model = write_checkpoint(tiny_config(num_nextn_predict_layers=1), tmp_path, seed=0)
    doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())["spec"]
    spec = PDRolloutSpec.model_validate({**doc, "model": {"path": str(model)}, "speculative": {"method": "mtp", "k": 3}})
    cfg = json.loads(builders.configmap("r", "ns", spec)["data"]["engine-config.json"])
    assert (cfg["speculative"], cfg["speculative_k"]) == ("mtp", 3) and "draft_model" not in cfg
    c = EngineConfig.model_validate({"model": spec.model.path, **cfg})
    assert (c.speculative, c.speculative_k, c.draft_model) == ("mtp", 3, None)
    off = json.loads(builders.configmap("r", "ns", spec_of("examples/pdrollout.yaml"))["data"]["engine-config.json"])
    assert "speculative" not in off


def test_engine_config_is_accepted_by_the_engine_and_args_point_at_it():
    spec = spec_of("examples/pdrollout.yaml")
    cm = builders.configmap("r", "ns", spec)
    cfg = json.loads(cm["data"]["engine-config.json"])
    EngineConfig.model_validate({"model": spec.model.path, **cfg})
    args = builders.engine_args(spec)
    assert args[args.index("--engine-config") + 1] == "/etc/pdrollout/engine-config.json"
    assert args[args.index("--port") + 1] == "30000" and args[0] == "serve"


def test_headless_service_publishes_not_ready_addresses():
    svc = builders.service("r", "ns", spec_of("examples/pdrollout.yaml"))
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"pdrollout.io/rollout": "r"}


def test_client_service_selects_node_0_alone():
    spec = spec_of("examples/pdrollout-2node.yaml")
    svc = builders.api_service("r", "ns", spec)
    assert svc["metadata"]["name"] == "r-api" and "clusterIP" not in svc["spec"]
    assert svc["spec"]["selector"] == {"pdrollout.io/rollout": "r", "apps.kubernetes.io/pod-index": "0"}
    assert svc["spec"]["ports"] == [{"name": "http", "port": 30000, "targetPort": "http"}]


def test_adopt_sets_controller_owner_reference():
    owner = {"apiVersion": "pdrollout.io/v1alpha1", "kind": "PDRollout",
             "metadata": {"name": "r", "namespace": "ns", "uid": "1234", "labels": {}}}
    objs = builders.desired_objects("r", "ns", spec_of("examples/pdrollout.yaml"), "tok", "ops")
    kopf.adopt(objs, owner=owner)
    for o in objs:
        (ref,) = o["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "pdrollout.io/v1alpha1", "kind": "PDRollout", "name": "r", "uid": "1234",
                       "controller": True, "blockOwnerDeletion": True}
    assert [o["kind"] for o in objs] == ["Secret", "NetworkPolicy", "ConfigMap", "Service", "Service",
                                         "StatefulSet"]


OVERRIDES = {
    "annotations": {"team": "rl"},
    "nodeSelector": {"pool": "h200"},
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}},
                 "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                     {"labelSelector": {"matchLabels": {"app": "x"}}, "topologyKey": "zone"}]}},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}],
    "imagePullSecrets": [{"name": "regcred"}],
    "priorityClassName": "rollout-high",
    "env": [{"name": "HF_HOME", "value": "/cache"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
    "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
    "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
}


def test_pod_template_overrides_merge_with_the_operators_winning():
    base = spec_of("examples/pdrollout.yaml")
    plain = builders.pod_template("r", "ns", base)
    spec = PDRolloutSpec.model_validate({**base.model_dump(by_alias=True), "podTemplate": OVERRIDES})
    tpl = builders.pod_template("r", "ns", spec)
    pod, c = tpl["spec"], tpl["spec"]["containers"][0]
    assert tpl["metadata"]["labels"] == plain["metadata"]["labels"]
    assert tpl["metadata"]["annotations"] == {"team": "rl", "pdrollout.io/template-hash":
                                              builders.template_hash("r", "ns", spec),
                                              "pdrollout.io/engine-config-hash": builders.engine_start_digest("r", "ns", spec)}
    assert pod["nodeSelector"] == {"pool": "h200"} and pod["priorityClassName"] == "rollout-high"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["tolerations"] == plain["spec"]["tolerations"] + OVERRIDES["tolerations"]
    assert pod["affinity"]["nodeAffinity"] == OVERRIDES["affinity"]["nodeAffinity"]
    ours = plain["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == \
        ours + OVERRIDES["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert c["env"] == plain["spec"]["containers"][0]["env"] + OVERRIDES["env"]
    assert pod["volumes"] == plain["spec"]["volumes"] + OVERRIDES["volumes"]
    assert c["volumeMounts"] == plain["spec"]["containers"][0]["volumeMounts"] + OVERRIDES["volumeMounts"]
    # Everything else is the operator's, unchanged.
    for key in ("securityContext", "automountServiceAccountToken", "shareProcessNamespace",
                "terminationGracePeriodSeconds"):
        assert pod[key] == plain["spec"][key]
    assert {k: v for k, v in c.items() if k not in ("env", "volumeMounts")} == \
        {k: v for k, v in plain["spec"]["containers"][0].items() if k not in ("env", "volumeMounts")}


def test_reserved_names_are_what_the_builders_use():
    """The CRD refuses overrides of these; they must be exactly the operator's own."""
    from pdrollout.operator import models
    volumes = set()
    for spec in (spec_of("examples/pdrollout.yaml"), spec_of("examples/pdrollout-2node.yaml")):
        pod = builders.pod_template("r", "ns", spec)["spec"]
        volumes |= {v["name"] for v in pod["volumes"]}   # the model's volumes: per source kind
        # The model's mount is at model.path, the user's own choice (a second mount there is refused
        # by the API server as a duplicate).
        assert {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]} == \
            {*models.RESERVED_MOUNTS, spec.model.path}
        for e in pod["containers"][0]["env"]:
            assert e["name"] in models.RESERVED_ENV or e["name"].startswith(models.RESERVED_ENV_PREFIXES), e
    assert volumes == set(models.RESERVED_VOLUMES)


def test_template_hash_tells_template_changes_and_only_those():
    """Pods carry the hash of the template they were made from; the operator recreates the group when it
    differs. Controls are not in the template, so they never change it; the image does."""
    base = spec_of("examples/pdrollout.yaml")
    sts = builders.statefulset("r", "ns", base)
    assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
    h = builders.template_hash("r", "ns", base)
    assert sts["spec"]["template"]["metadata"]["annotations"]["pdrollout.io/template-hash"] == h
    controls = base.model_copy(update={"multiplexing": base.multiplexing.model_copy(update={"span": 3})})
    assert builders.template_hash("r", "ns", controls) == h
    assert builders.template_hash("r", "ns", base.model_copy(update={"image": "other:1"})) != h
    assert builders.template_hash("r2", "ns", base) != h


def test_gang_makes_a_pod_group_and_hands_the_pods_to_its_scheduler():
    base = spec_of("examples/pdrollout-2node.yaml")
    assert "PodGroup" not in [o["kind"] for o in builders.desired_objects("r", "ns", base, "t", "ops")]
    assert "schedulerName" not in builders.pod_template("r", "ns", base)["spec"]
    spec = PDRolloutSpec.model_validate({**base.model_dump(by_alias=True, exclude_none=True),
                                         "gang": {"schedulerName": "gang-sched", "scheduleTimeoutSeconds": 60}})
    kinds = [o["kind"] for o in builders.desired_objects("r", "ns", spec, "t", "ops")]
    assert kinds.index("PodGroup") < kinds.index("StatefulSet")   # the group exists before its pods
    pg = builders.pod_group("r", "ns", spec)
    assert pg["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert pg["spec"] == {"minMember": 2, "scheduleTimeoutSeconds": 60}
    tpl = builders.pod_template("r", "ns", spec)
    assert tpl["spec"]["schedulerName"] == "gang-sched"
    assert tpl["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "r"
    sts = builders.statefulset("r", "ns", spec)
    assert sts["spec"]["selector"]["matchLabels"].items() <= tpl["metadata"]["labels"].items()


def test_topology_key_keeps_the_group_in_one_domain():
    doc = yaml.safe_load((ROOT / "examples/pdrollout-2node.yaml").read_text())["spec"]
    spec = PDRolloutSpec.model_validate({**doc, "placement": {"topologyKey": "example.com/rack"}})
    pod = builders.statefulset("big", "rl", spec)["spec"]["template"]["spec"]
    (together,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert together == {"labelSelector": {"matchExpressions": [{"key": "pdrollout.io/rollout", "operator": "In",
                                                                "values": ["big"]}]},
                        "topologyKey": "example.com/rack"}
    # A user's own podAffinity is added to it, not put in its place.
    theirs = {"labelSelector": {"matchLabels": {"app": "trainer"}}, "topologyKey": "example.com/spine"}
    spec = PDRolloutSpec.model_validate({**doc, "placement": {"topologyKey": "example.com/rack"}, "podTemplate": {
        "affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [theirs]}}}})
    pod = builders.statefulset("big", "rl", spec)["spec"]["template"]["spec"]
    assert pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [together, theirs]
    with pytest.raises(ValidationError, match="topologyKey|topology_key"):
        PDRolloutSpec.model_validate({**doc, "placement": {"topologyKey": "not a label/"}})


def test_cluster_domain_is_the_operators_setting():
    """The master address ends in the operator's cluster domain ($PDROLLOUT_OPERATOR_CLUSTER_DOMAIN, the
    chart's clusterDomain); a value that is no DNS domain stops the operator at start, naming it."""
    code = ("from pdrollout.operator import builders, handlers; handlers.cluster_domain(); "
            "print(builders.master_address('r', 'ns'))")
    env = {**os.environ, "PDROLLOUT_OPERATOR_CLUSTER_DOMAIN": "corp.example"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "r-0.r.ns.svc.corp.example", out.stderr
    env["PDROLLOUT_OPERATOR_CLUSTER_DOMAIN"] = "Corp_Example"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "PDROLLOUT_OPERATOR_CLUSTER_DOMAIN='Corp_Example' is not a DNS domain" in out.stderr
