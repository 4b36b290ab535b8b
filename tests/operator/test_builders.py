"""Pure builders: exact objects and env from a spec, no cluster."""
import json
from pathlib import Path

import kopf
import pytest
import yaml

from pdrollout.engine.config import EngineConfig
from pdrollout.engine.distributed import netenv
from pdrollout.operator import builders
from pdrollout.operator.models import PDRolloutSpec

ROOT = Path(__file__).resolve().parents[2]


def spec_of(path: str) -> PDRolloutSpec:
    return PDRolloutSpec.model_validate(yaml.safe_load((ROOT / path).read_text())["spec"])


def env_map(env: list[dict]) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in env}


def test_two_node_ep16_adp8_env_is_exact():
    env = env_map(builders.engine_env("big", "rl", spec_of("examples/pdrollout-2node.yaml")))
    hcas = ",".join(f"mlx5_{i}:1" for i in range(8))
    assert env == {
        "PDROLLOUT_NODE_RANK": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}},
        "POD_NAME": {"fieldRef": {"fieldPath": "metadata.name"}},
        "POD_IP": {"fieldRef": {"fieldPath": "status.podIP"}},
        "PDROLLOUT_ROLLOUT": "big",
        "PDROLLOUT_NNODES": "2",
        "PDROLLOUT_GPUS_PER_NODE": "8",
        "PDROLLOUT_WORLD_SIZE": "16",
        "PDROLLOUT_MASTER_ADDR": "big-0.big.rl.svc.cluster.local",
        "PDROLLOUT_MASTER_PORT": "29500",
        "PDROLLOUT_EP": "16", "PDROLLOUT_ADP": "8", "PDROLLOUT_ATP": "2", "PDROLLOUT_ETP": "1",
        "PDROLLOUT_PORT": "30000",
        "PDROLLOUT_ROLLOUT_INFO": "/etc/pdrollout/rollout.json",
        "NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": hcas, "NCCL_NVLS_ENABLE": "0",
        "NVSHMEM_IB_ENABLE_IBGDA": "1", "NVSHMEM_QP_DEPTH": "1024", "NVSHMEM_IBGDA_NUM_RC_PER_PE": "16",
        "NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_HCA_LIST": hcas, "NVSHMEM_MAX_TEAMS": "7",
        "NVSHMEM_CUMEM_GRANULARITY": str(1 << 29), "NVSHMEM_DISABLE_P2P": "0",
        "PDROLLOUT_QP_RANGE_D": "0:8", "PDROLLOUT_QP_RANGE_P": "8:16",
    }


@pytest.mark.parametrize("s", [1, 8, 24])
def test_qp_ranges_split_phases_as_the_engine_does(s):
    spec = PDRolloutSpec.model_validate({"image": "i", "model": {"path": "/m"},
                                         "network": {"nvshmem": {"qpsPerRank": s}}})
    env = env_map(builders.engine_env("r", "ns", spec))
    split = netenv.qp_split(s)
    assert env["PDROLLOUT_QP_RANGE_D"] == f"0:{s}" and env["PDROLLOUT_QP_RANGE_P"] == f"{s}:{2 * s}"
    assert (split.decode, split.prefill) == (range(0, s), range(s, 2 * s))
    assert env["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == str(2 * s) == str(split.total)


def test_ibgda_only_between_nodes_and_only_if_wanted():
    one = spec_of("examples/pdrollout.yaml")
    assert env_map(builders.engine_env("r", "ns", one))["NVSHMEM_IB_ENABLE_IBGDA"] == "0"  # NVLink inside a node
    two = spec_of("examples/pdrollout-2node.yaml")
    assert env_map(builders.engine_env("r", "ns", two))["NVSHMEM_IB_ENABLE_IBGDA"] == "1"
    off = two.model_copy(update={"network": two.network.model_copy(
        update={"nvshmem": two.network.nvshmem.model_copy(update={"ibgda": False})})})
    assert env_map(builders.engine_env("r", "ns", off))["NVSHMEM_IB_ENABLE_IBGDA"] == "0"
    assert "NCCL_IB_HCA" not in env_map(builders.engine_env("r", "ns", one)), "no HCAs listed: none set"


@pytest.mark.parametrize("nodes,gpus,ep,adp,atp,etp", [
    (1, 8, 8, 2, 4, 1), (1, 8, 8, 8, 1, 1), (2, 8, 16, 8, 2, 1), (2, 8, 8, 16, 1, 2), (1, 4, 2, 1, 4, 2)])
def test_topology_arithmetic(nodes, gpus, ep, adp, atp, etp):
    spec = PDRolloutSpec.model_validate({
        "image": "i", "model": {"path": "/m"}, "network": {"ibHCAs": ["mlx5_0"]},
        "topology": {"nodes": nodes, "gpusPerNode": gpus, "expertParallel": ep, "attentionDataParallel": adp}})
    env = env_map(builders.engine_env("r", "ns", spec))
    assert env["PDROLLOUT_WORLD_SIZE"] == str(nodes * gpus)
    assert (env["PDROLLOUT_ATP"], env["PDROLLOUT_ETP"]) == (str(atp), str(etp))
    info = builders.rollout_info("r", "ns", spec)
    assert info["attentionTP"] * info["attentionDataParallel"] == info["worldSize"]
    assert info["expertTP"] * info["expertParallel"] == info["worldSize"]


def test_statefulset_one_pod_per_node_with_all_gpus_and_exclusive_placement():
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
    term = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchExpressions"] == [{"key": "pdrollout.io/rollout", "operator": "Exists"}]
    assert sts["spec"]["selector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()


def test_no_rdma_requested_when_zero():
    spec = PDRolloutSpec.model_validate({"image": "i", "model": {"path": "/m"}, "resources": {"rdmaPerNode": 0}})
    limits = builders.statefulset("r", "ns", spec)["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "rdma/ib" not in limits and limits["nvidia.com/gpu"] == "8"


def test_multiplexing_is_not_in_the_pod_template():
    """A control change must never change the template (that would restart the pods)."""
    base = spec_of("examples/pdrollout.yaml")
    changed = base.model_copy(update={"multiplexing": base.multiplexing.model_copy(
        update={"activation": "on", "span": 3, "ordering": "global-enqueue"})})
    assert builders.statefulset("r", "ns", base) == builders.statefulset("r", "ns", changed)
    assert builders.configmap("r", "ns", base) != builders.configmap("r", "ns", changed)
    cfg = json.loads(builders.configmap("r", "ns", changed)["data"]["engine-config.json"])
    assert cfg["control"] == {"activation": "on", "span": 3, "prefill_budget_tokens": 32768,
                              "ordering": "global-enqueue"}


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


def test_adopt_sets_controller_owner_reference():
    owner = {"apiVersion": "pdrollout.io/v1alpha1", "kind": "PDRollout",
             "metadata": {"name": "r", "namespace": "ns", "uid": "1234", "labels": {}}}
    objs = builders.desired_objects("r", "ns", spec_of("examples/pdrollout.yaml"))
    kopf.adopt(objs, owner=owner)
    for o in objs:
        (ref,) = o["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "pdrollout.io/v1alpha1", "kind": "PDRollout", "name": "r", "uid": "1234",
                       "controller": True, "blockOwnerDeletion": True}
    assert [o["kind"] for o in objs] == ["ConfigMap", "Service", "StatefulSet"]
