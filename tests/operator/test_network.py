"""spec.network rendered through the operator's own builders: for every example under examples/, the pod's
NCCL/NVSHMEM env, RDMA resources, Multus annotation and host namespaces, written out; the NVSHMEM
settings DeepEP reads; and what the models refuse, by name."""
import json
from pathlib import Path

import pydantic
import pytest
import yaml

from pdrollout.engine.protocol import netenv
from pdrollout.operator import builders, network
from pdrollout.operator.models import PDRolloutSpec

ROOT = Path(__file__).resolve().parents[2]
HCAS8 = ",".join(f"mlx5_{i}:1" for i in range(8))
NCCL_BASE = {"NCCL_NVLS_ENABLE": "0"}   # NVLink multicast off on every CUDA pod

# What each example's pod must carry, written out (not recomputed by the code under test).
EXAMPLES = {
    "pdrollout.yaml": dict(
        env={**NCCL_BASE, "NCCL_SOCKET_IFNAME": "eth0", "NVSHMEM_IB_ENABLE_IBGDA": "0",
             "NVSHMEM_IBGDA_NUM_RC_PER_PE": "32", "NVSHMEM_QP_DEPTH": "1024", "NVSHMEM_DISABLE_NVLS": "1",
             "NVSHMEM_MAX_TEAMS": "7", "NVSHMEM_CUMEM_GRANULARITY": str(1 << 29), "NVSHMEM_DISABLE_P2P": "0",
             "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "eth0"},
        rdma={"rdma/ib": "1"}, annotations={}, pod={}),
    "pdrollout-2node.yaml": dict(
        env={**NCCL_BASE, "NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": HCAS8},
        rdma={"rdma/ib": "8"}, annotations={}, pod={}),
    "pdrollout-cpu.yaml": dict(env={}, rdma={}, annotations={}, pod={}),
    "pdrollout-h20-roce.yaml": dict(
        env={**NCCL_BASE, "NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": HCAS8, "NCCL_IB_GID_INDEX": "3",
             "NCCL_IB_TC": "106", "NCCL_IB_QPS_PER_CONNECTION": "2", "NCCL_IB_TIMEOUT": "22",
             "NCCL_IB_RETRY_CNT": "7"},
        rdma={f"nvidia.com/roce_rail{i}": "1" for i in range(8)},
        annotations={"k8s.v1.cni.cncf.io/networks": ",".join(f"roce-rail{i}" for i in range(8))}, pod={}),
    "pdrollout-ib.yaml": dict(
        env={**NCCL_BASE, "NCCL_SOCKET_IFNAME": "bond0", "NCCL_IB_HCA": HCAS8, "NCCL_IB_SL": "1",
             "NCCL_IB_ADAPTIVE_ROUTING": "1"},
        rdma={"rdma/hca_shared_devices_a": "1"}, annotations={},
        pod={"hostNetwork": True, "hostIPC": True, "dnsPolicy": "ClusterFirstWithHostNet"}),
}
HOST_FIELDS = ("hostNetwork", "hostIPC", "dnsPolicy")
NOT_DEVICES = {"cpu", "memory", "nvidia.com/gpu"}


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "examples" / name).read_text())


def spec_of(doc: dict, **changes) -> PDRolloutSpec:
    return PDRolloutSpec.model_validate({**doc["spec"], **changes})


def rendered(spec: PDRolloutSpec, name="r", ns="ns") -> tuple[dict, dict, dict]:
    """(pod template, engine container, its env as a map) of the StatefulSet the operator applies."""
    tpl = builders.statefulset(name, ns, spec)["spec"]["template"]
    c = tpl["spec"]["containers"][0]
    return tpl, c, {e["name"]: e.get("value") for e in c["env"]}


def test_every_example_has_its_network_written_out():
    assert {p.name for p in (ROOT / "examples").glob("*.yaml")} == set(EXAMPLES)


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_example_pod_carries_its_network(example):
    want = EXAMPLES[example]
    doc = load(example)
    tpl, c, env = rendered(spec_of(doc), doc["metadata"]["name"])
    assert {k: v for k, v in env.items() if k.startswith(("NCCL_", "NVSHMEM_"))} == want["env"]
    req, lim = c["resources"]["requests"], c["resources"]["limits"]
    assert {k: v for k, v in req.items() if k not in NOT_DEVICES} == want["rdma"] and lim == req
    annotations = {k: v for k, v in (tpl["metadata"].get("annotations") or {}).items()
                   if not k.startswith("pdrollout.io/")}
    assert annotations == want["annotations"]
    assert {k: tpl["spec"][k] for k in HOST_FIELDS if k in tpl["spec"]} == want["pod"]


def deep_ep(**network) -> PDRolloutSpec:
    doc = load("pdrollout.yaml")
    return spec_of(doc, network={**doc["spec"]["network"], **network})


def test_nvshmem_reads_the_ib_settings_hca_list_and_pe_mapping():
    spec = deep_ep(ibHCAs=["mlx5_0", "mlx5_1"], ib={"gidIndex": 3, "trafficClass": 106, "serviceLevel": 2},
                   nvshmem={"qpsPerRank": 16, "hcas": ["mlx5_4", "mlx5_5:2"],
                            "hcaPeMapping": [{"hca": "mlx5_4", "pes": 4}, {"hca": "mlx5_5", "port": 2, "pes": 4}]})
    _, _, env = rendered(spec)
    assert {k: env[k] for k in ("NCCL_IB_GID_INDEX", "NCCL_IB_TC", "NCCL_IB_SL", "NCCL_IB_HCA")} == \
        {"NCCL_IB_GID_INDEX": "3", "NCCL_IB_TC": "106", "NCCL_IB_SL": "2", "NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1"}
    assert {k: env[k] for k in ("NVSHMEM_IB_GID_INDEX", "NVSHMEM_IB_TRAFFIC_CLASS", "NVSHMEM_IB_SL",
                                "NVSHMEM_HCA_LIST", "NVSHMEM_ENABLE_NIC_PE_MAPPING", "NVSHMEM_HCA_PE_MAPPING")} == {
        "NVSHMEM_IB_GID_INDEX": "3", "NVSHMEM_IB_TRAFFIC_CLASS": "106", "NVSHMEM_IB_SL": "2",
        "NVSHMEM_HCA_LIST": "mlx5_4:1,mlx5_5:2",          # nvshmem.hcas, not ibHCAs
        "NVSHMEM_ENABLE_NIC_PE_MAPPING": "1", "NVSHMEM_HCA_PE_MAPPING": "mlx5_4:1:4,mlx5_5:2:4"}
    split = netenv.qp_split_from_env(env, local_experts=16)   # the DeepEP backend still reads its split
    assert (split.decode, split.prefill) == (range(0, 16), range(16, 32))
    # Without hcas of its own, NVSHMEM uses the rollout's HCAs; without settings, none of the variables.
    _, _, env = rendered(deep_ep(ibHCAs=["mlx5_0"]))
    assert env["NVSHMEM_HCA_LIST"] == "mlx5_0:1"
    assert not {"NVSHMEM_IB_GID_INDEX", "NVSHMEM_IB_SL", "NVSHMEM_HCA_PE_MAPPING", "NVSHMEM_ENABLE_NIC_PE_MAPPING",
                "NCCL_IB_TC", "NCCL_IB_QPS_PER_CONNECTION"} & set(env)


@pytest.mark.parametrize("ibgda,want", [(True, "1"), (False, "0"), (None, "0")])
def test_ibgda_renders_as_written_and_unset_stays_off_inside_a_node(ibgda, want):
    """The 1-node example once said `ibgda: true` and rendered IBGDA=0."""
    nv = {"qpsPerRank": 16, **({} if ibgda is None else {"ibgda": ibgda})}
    _, _, env = rendered(deep_ep(nvshmem=nv))
    assert env["NVSHMEM_IB_ENABLE_IBGDA"] == want


def test_extra_env_reaches_the_engine_and_changes_the_template():
    base = deep_ep()
    extra = deep_ep(env=[{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "NVSHMEM_DEBUG", "value": "WARN"}])
    _, c, env = rendered(extra)
    assert (env["NCCL_DEBUG"], env["NVSHMEM_DEBUG"]) == ("INFO", "WARN")
    assert [e["name"] for e in c["env"]].count("NCCL_DEBUG") == 1
    assert builders.template_hash("r", "ns", base) != builders.template_hash("r", "ns", extra)


@pytest.mark.parametrize("field", sorted(network.OWNED_ENV))
def test_an_owned_variable_in_network_env_is_refused_by_name(field):
    with pytest.raises(pydantic.ValidationError, match=f"network.env may not set {field} \\(set "):
        deep_ep(env=[{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": field, "value": "1"}])


def test_every_owned_variable_is_one_the_builders_render():
    """The refusal list is the operator's own: each name appears in some rendered pod."""
    roce = deep_ep(ibHCAs=["mlx5_0"], ib={"gidIndex": 3, "trafficClass": 106, "serviceLevel": 2,
                                         "qpsPerConnection": 2},
                   nvshmem={"qpsPerRank": 16, "hcaPeMapping": [{"hca": "mlx5_0", "pes": 8}]})
    assert set(network.OWNED_ENV) == {k for k in rendered(roce)[2] if k.startswith(("NCCL_", "NVSHMEM_"))}


REFUSED = [
    ({"network": {"env": [{"name": "LD_PRELOAD", "value": "x"}]}},
     "network.env holds NCCL_* and NVSHMEM_* variables only, not LD_PRELOAD"),
    ({"network": {"env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "NCCL_DEBUG", "value": "WARN"}]}},
     "network.env names each variable once"),
    ({"expertBackend": "torch"}, "network.nvshmem applies to expertBackend deep_ep only"),
    ({"network": {"hostNetwork": True, "attachments": ["rail0"]}}, "network.attachments need the pod's own network"),
    ({"network": {"attachments": ["Bad_Name"]}}, "attachments"),
    ({"network": {"nvshmem": {"hcaPeMapping": [{"hca": "mlx5_0", "pes": 4}]}}}, "its pes add up to topology.gpusPerNode"),
    ({"network": {"nvshmem": {"nicPeMapping": False, "hcaPeMapping": [{"hca": "mlx5_0", "pes": 8}]}}},
     "hcaPeMapping needs nicPeMapping"),
    ({"network": {"rdmaResources": [{"name": "nvidia.com/rail0"}, {"name": "nvidia.com/rail0"}]}},
     "names each resource once"),
    ({"network": {"rdmaResources": [{"name": "rdma/ib"}]}}, "repeats resources.rdmaResource"),
    ({"network": {"rdmaResources": [{"name": "rail0"}]}}, "rdmaResources"),
    ({"network": {"ib": {"serviceLevel": 16}}}, "serviceLevel"),
    ({"network": {"attachments": ["rail0"]}, "podTemplate": {"annotations": {network.MULTUS_ANNOTATION: "x"}}},
     "not both"),
]


@pytest.mark.parametrize("change,message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_network_mistakes_are_refused_with_the_field(change, message):
    doc = load("pdrollout.yaml")["spec"]
    spec = {**doc, **change, "network": {**doc["network"], **change.get("network", {})}}
    PDRolloutSpec.model_validate({**doc, "network": doc["network"]})   # the base is valid
    with pytest.raises(pydantic.ValidationError, match=message.replace("*", "\\*").replace("(", "\\(")):
        PDRolloutSpec.model_validate(spec)


def test_rdma_rails_on_cpu_are_refused():
    doc = load("pdrollout-cpu.yaml")["spec"]
    with pytest.raises(pydantic.ValidationError, match="network.rdmaResources needs device cuda"):
        PDRolloutSpec.model_validate({**doc, "network": {"rdmaResources": [{"name": "rdma/ib"}]}})


def test_two_nodes_may_take_their_rdma_devices_from_rails_alone():
    doc = load("pdrollout-h20-roce.yaml")["spec"]
    assert doc["resources"]["rdmaPerNode"] == 0
    PDRolloutSpec.model_validate(doc)
    with pytest.raises(pydantic.ValidationError, match="a two-node rollout needs resources.rdmaPerNode > 0 or"):
        PDRolloutSpec.model_validate({**doc, "network": {**doc["network"], "rdmaResources": []}})


def test_network_crd_schema_is_served_shape():
    """The CEL rules of spec.network name the fields they check (what `kubectl apply` prints)."""
    from pdrollout.operator import crd
    spec = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    net = spec["properties"]["network"]
    assert set(net["properties"]) >= {"rdmaResources", "hostNetwork", "hostIPC", "attachments", "ib", "nvshmem", "env"}
    assert net["properties"]["env"]["maxItems"] == network.MAX_EXTRA_ENV
    rules = json.dumps(spec["x-kubernetes-validations"])
    for _, message in network.SPEC_RULES:
        assert json.dumps(message)[1:-1] in rules


@pytest.mark.cluster
def test_examples_and_their_pods_pass_the_api_server(cluster, installed, namespace):
    """On the real API server: every example is admitted (the CRD's CEL rules compile and accept it), and
    the StatefulSet the builders make from it passes the server's own pod validation (hostNetwork with
    its DNS policy, the RDMA resources as extended resources, the Multus annotation)."""
    for example in sorted(EXAMPLES):
        doc = load(example)
        r = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc),
                            check=False)
        assert r.returncode == 0, f"{example}: {r.stderr}"
        sts = builders.statefulset(doc["metadata"]["name"], namespace, spec_of(doc))
        r = cluster.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(sts),
                            check=False)
        assert r.returncode == 0, f"{example}'s StatefulSet: {r.stderr}"
        served = json.loads(r.stdout)["spec"]["template"]
        assert {k: served["spec"][k] for k in HOST_FIELDS if k in served["spec"] and k != "dnsPolicy"} == \
            {k: v for k, v in EXAMPLES[example]["pod"].items() if k != "dnsPolicy"}
        assert served["spec"]["dnsPolicy"] == EXAMPLES[example]["pod"].get("dnsPolicy", "ClusterFirst")


def test_a_rollout_stored_before_issue_52_stays_readable():
    """The old CRD defaulted network.nvshmem into every stored rollout: the operator must still read a
    torch one (not a PermanentError that stops managing it) and keep IBGDA off inside a deep_ep node."""
    legacy = dict(network.LEGACY_NVSHMEM_DEFAULT)
    doc = load("pdrollout-2node.yaml")["spec"]
    spec = PDRolloutSpec.model_validate({**doc, "network": {**doc["network"], "nvshmem": legacy}})
    assert spec.network.nvshmem is None
    assert rendered(spec)[2] == rendered(spec_of(load("pdrollout-2node.yaml")))[2]
    one = load("pdrollout.yaml")["spec"]
    _, _, env = rendered(PDRolloutSpec.model_validate({**one, "network": {"nvshmem": legacy}}))
    assert env["NVSHMEM_IB_ENABLE_IBGDA"] == "0" and env["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "16"
    # Written by hand on the torch backend, anything but that stored default is refused.
    with pytest.raises(pydantic.ValidationError, match="network.nvshmem applies to expertBackend deep_ep only"):
        PDRolloutSpec.model_validate({**doc, "network": {**doc["network"], "nvshmem": {**legacy, "qpsPerRank": 4}}})
