"""spec.network: how a group's pods reach each other (RDMA devices, host networking, Multus attachments,
InfiniBand/RoCE settings, NVSHMEM) and the env NCCL and NVSHMEM read from it. The models here are part of
the CRD (models.py nests `Network`); the render functions are the builders' network hooks. Every
variable comes from one field, so the operator owns it and the user's `network.env` may not set it."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator
from pydantic.alias_generators import to_camel

from pdrollout.engine.protocol import netenv

if TYPE_CHECKING:
    from pdrollout.operator.models import PDRolloutSpec

MULTUS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"
QPDepth = Literal[64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
MAX_RAILS = 16
# An extended resource ("domain/name"): RDMA device plugins (rdma/ib, rdma/rdma_shared_device_a,
# nvidia.com/rail0 from SR-IOV) all use one.
RESOURCE_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
# Multus' short form: [namespace/]network[@interface]
ATTACHMENT = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9.]*[a-z0-9])?(@[A-Za-z0-9_.-]{1,15})?$"
HCA = r"^[A-Za-z0-9_.-]+(:[0-9]+)?$"
EXTRA_ENV = r"^(NCCL|NVSHMEM)_[A-Z0-9_]+$"
Attachment = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=ATTACHMENT)]
HcaName = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=HCA)]

# Each variable the operator renders -> the field it comes from (what a refusal tells the user to set).
OWNED_ENV = {
    "NCCL_SOCKET_IFNAME": "network.socketIfname",
    "NCCL_IB_HCA": "network.ibHCAs",
    "NCCL_NVLS_ENABLE": "the operator (NVLink multicast stays off)",
    "NCCL_IB_GID_INDEX": "network.ib.gidIndex",
    "NCCL_IB_TC": "network.ib.trafficClass",
    "NCCL_IB_SL": "network.ib.serviceLevel",
    "NCCL_IB_QPS_PER_CONNECTION": "network.ib.qpsPerConnection",
    "NVSHMEM_IB_ENABLE_IBGDA": "network.nvshmem.ibgda",
    "NVSHMEM_IBGDA_NUM_RC_PER_PE": "network.nvshmem.qpsPerRank",
    "NVSHMEM_QP_DEPTH": "network.nvshmem.qpDepth",
    "NVSHMEM_DISABLE_NVLS": "the operator (NVLink multicast stays off)",
    "NVSHMEM_MAX_TEAMS": "the operator (DeepEP's setting)",
    "NVSHMEM_CUMEM_GRANULARITY": "the operator (DeepEP's setting)",
    "NVSHMEM_DISABLE_P2P": "the operator (NVLink carries traffic inside a node)",
    "NVSHMEM_HCA_LIST": "network.nvshmem.hcas or network.ibHCAs",
    "NVSHMEM_IB_GID_INDEX": "network.ib.gidIndex",
    "NVSHMEM_IB_TRAFFIC_CLASS": "network.ib.trafficClass",
    "NVSHMEM_IB_SL": "network.ib.serviceLevel",
    "NVSHMEM_ENABLE_NIC_PE_MAPPING": "network.nvshmem.nicPeMapping or hcaPeMapping",
    "NVSHMEM_HCA_PE_MAPPING": "network.nvshmem.hcaPeMapping",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "network.socketIfname",
}


def _rules(*rules: dict) -> dict:
    return {"x-kubernetes-validations": list(rules)}


def _cel_list(values) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class RdmaResource(_Model):
    name: str = Field(min_length=3, max_length=253, pattern=RESOURCE_NAME,
                      description="An RDMA device plugin's extended resource, e.g. rdma/ib or nvidia.com/rail0.")
    count: int = Field(default=1, ge=1, le=64, description="Devices of it per pod (per node).")


class InfiniBand(_Model):
    # RoCE needs a GID index and usually a traffic class; an InfiniBand fabric may isolate traffic by
    # service level (virtual lanes).

    gid_index: int | None = Field(default=None, ge=0, le=255, description=(
        "NCCL_IB_GID_INDEX and NVSHMEM_IB_GID_INDEX (RoCE v2 is usually 3)."))
    traffic_class: int | None = Field(default=None, ge=0, le=255, description=(
        "NCCL_IB_TC and NVSHMEM_IB_TRAFFIC_CLASS (RoCE: DSCP << 2, the lossless class of the switch)."))
    service_level: int | None = Field(default=None, ge=0, le=15, description="NCCL_IB_SL and NVSHMEM_IB_SL.")
    qps_per_connection: int | None = Field(default=None, ge=1, le=128,
                                           description="NCCL_IB_QPS_PER_CONNECTION (RoCE ECMP spreads over them).")


MAX_EXTRA_ENV = 32


class ExtraEnv(_Model):
    name: str = Field(min_length=1, max_length=64)
    value: str = Field(max_length=1024)


class HcaPe(_Model):
    hca: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    port: int = Field(default=1, ge=1, le=255)
    pes: int = Field(ge=1, le=8, description="Ranks (PEs) of the pod that use this HCA.")


class Nvshmem(_Model):
    # NVSHMEM of the DeepEP backend (expertBackend deep_ep only: the torch backend runs on NCCL).
    model_config = ConfigDict(json_schema_extra=_rules({
        "rule": "size(self.hcaPeMapping) == 0 || !has(self.nicPeMapping) || self.nicPeMapping",
        "message": "network.nvshmem.hcaPeMapping needs nicPeMapping (NVSHMEM reads the mapping only with it on)"}))

    ibgda: bool | None = Field(default=None, description=(
        "NVSHMEM_IB_ENABLE_IBGDA. Unset: on between nodes, off inside one (NVLink carries it); set: as written."))
    qp_depth: QPDepth = Field(default=1024, description="NVSHMEM_QP_DEPTH (a power of two).")
    qps_per_rank: int = Field(default=8, ge=1, le=64,
                              description="QPs per rank for each phase: D owns [0,s), P owns [s,2s).")
    hcas: list[HcaName] = Field(default=[], max_length=MAX_RAILS,
                            description="NVSHMEM_HCA_LIST; empty: network.ibHCAs.")
    nic_pe_mapping: bool | None = Field(default=None, description=(
        "NVSHMEM_ENABLE_NIC_PE_MAPPING: NICs assigned round-robin (or by hcaPeMapping) rather than nearest."))
    hca_pe_mapping: list[HcaPe] = Field(default=[], max_length=MAX_RAILS, description=(
        "NVSHMEM_HCA_PE_MAPPING (hca:port:pes,...); the PEs add up to gpusPerNode."))

    @model_validator(mode="after")
    def _mapping(self) -> "Nvshmem":  # mirrors the CEL rule above
        if self.hca_pe_mapping and self.nic_pe_mapping is False:
            raise ValueError("network.nvshmem.hcaPeMapping needs nicPeMapping (NVSHMEM reads the mapping only "
                             "with it on)")
        return self


_OWNED = _cel_list(OWNED_ENV)


class Network(_Model):
    model_config = ConfigDict(json_schema_extra=_rules({
        "rule": "!self.hostNetwork || size(self.attachments) == 0",
        "message": "network.attachments need the pod's own network namespace: not with hostNetwork "
                   "(Multus attaches nothing to a host-network pod)"}))

    socket_ifname: str = Field(default="eth0", min_length=1, description="NCCL/Gloo socket interface.")
    ib_hcas: list[str] = Field(default=[], alias="ibHCAs", description="RDMA devices, e.g. mlx5_0.")
    rdma_resources: list[RdmaResource] = Field(default=[], max_length=MAX_RAILS, description=(
        "RDMA devices per pod by resource, one entry per rail (added to resources.rdmaResource)."),
        json_schema_extra=_rules({"rule": "self.all(r, self.exists_one(s, s.name == r.name))",
                                  "message": "network.rdmaResources names each resource once"}))
    host_network: bool = Field(default=False, description=(
        "The pods use the node's network (the RDMA NICs' netdevs); DNS through the cluster "
        "(dnsPolicy ClusterFirstWithHostNet)."))
    host_ipc: bool = Field(default=False, alias="hostIPC", description="The node's IPC namespace (CUDA IPC across pods).")
    attachments: list[Attachment] = Field(default=[], max_length=MAX_RAILS, description=(
        f"Multus NetworkAttachmentDefinitions ([namespace/]name[@interface]), the pod's {MULTUS_ANNOTATION}."))
    ib: InfiniBand = Field(default_factory=InfiniBand, description=(
        "Queue-pair settings NCCL and NVSHMEM both read; unset: the libraries' own choice."))
    nvshmem: Nvshmem | None = Field(default=None, description="expertBackend deep_ep only.")
    env: list[ExtraEnv] = Field(default=[], max_length=MAX_EXTRA_ENV, description=(
        "Extra NCCL_*/NVSHMEM_* variables (e.g. NCCL_IB_TIMEOUT); not the ones the operator sets from the "
        "fields above."), json_schema_extra=_rules(
        # Static messages: a messageExpression over the list exceeds the API server's cost budget.
        {"rule": f"self.all(e, e.name.matches('{EXTRA_ENV}'))",
         "message": "network.env holds NCCL_* and NVSHMEM_* variables only"},
        {"rule": f"self.all(e, !(e.name in {_OWNED}))",
         "message": "network.env may not set a variable the operator sets from network fields: "
                    + ", ".join(OWNED_ENV)},
        {"rule": "self.all(e, self.exists_one(f, f.name == e.name))", "message": "network.env names each variable once"}))

    @model_validator(mode="after")
    def _host(self) -> "Network":  # mirrors the CEL rule above
        if self.host_network and self.attachments:
            raise ValueError("network.attachments need the pod's own network namespace: not with hostNetwork "
                             "(Multus attaches nothing to a host-network pod)")
        return self

    @field_validator("rdma_resources")
    @classmethod
    def _unique(cls, v):  # mirrors the CEL rule
        names = [r.name for r in v]
        if len(set(names)) != len(names):
            raise ValueError("network.rdmaResources names each resource once")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v):  # mirrors the CEL rules
        names = [e.name for e in v]
        if bad := [k for k in names if not re.match(EXTRA_ENV, k)]:
            raise ValueError(f"network.env holds NCCL_* and NVSHMEM_* variables only, not {', '.join(bad)}")
        if owned := [k for k in names if k in OWNED_ENV]:
            raise ValueError("network.env may not set " + ", ".join(f"{k} (set {OWNED_ENV[k]})" for k in owned))
        if len(set(names)) != len(names):
            raise ValueError("network.env names each variable once")
        return v


# What the CRD before issue 52 stored in every rollout (network.nvshmem was a defaulted object): the
# operator reads it as unset, so a torch rollout stays managed (the CRD refuses the block on its next spec
# write, naming it) and a deep_ep one keeps IBGDA off inside its node.
LEGACY_NVSHMEM_DEFAULT = {"ibgda": True, "qpDepth": 1024, "qpsPerRank": 8}


def drop_legacy_default(data):
    net = data.get("network") if isinstance(data, dict) else None
    if isinstance(net, dict) and net.get("nvshmem") == LEGACY_NVSHMEM_DEFAULT:
        return {**data, "network": {k: v for k, v in net.items() if k != "nvshmem"}}
    return data


# Cross-field rules (the spec's, since they read topology, device and resources too).
SPEC_RULES = (
    ("!has(self.network.nvshmem) || self.expertBackend == 'deep_ep'",
     "network.nvshmem applies to expertBackend deep_ep only (the torch backend's all-to-alls run on NCCL)"),
    ("self.device == 'cuda' || size(self.network.rdmaResources) == 0",
     "network.rdmaResources needs device cuda (CPU ranks use no RDMA device)"),
    ("self.resources.rdmaPerNode == 0 || self.network.rdmaResources.all(r, r.name != self.resources.rdmaResource)",
     "network.rdmaResources repeats resources.rdmaResource: list it once"),
    ("!has(self.network.nvshmem) || size(self.network.nvshmem.hcaPeMapping) == 0 || "
     "self.network.nvshmem.hcaPeMapping.map(m, m.pes).sum() == self.topology.gpusPerNode",
     "network.nvshmem.hcaPeMapping must map every rank of a pod: its pes add up to topology.gpusPerNode"),
    (f"size(self.network.attachments) == 0 || !('{MULTUS_ANNOTATION}' in self.podTemplate.annotations)",
     f"set Multus networks in network.attachments or podTemplate.annotations['{MULTUS_ANNOTATION}'], not both"),
)


def check_spec(spec: "PDRolloutSpec") -> None:
    """The SPEC_RULES, for the operator's own validation (same order, same messages)."""
    net = spec.network
    rdma_names = {r.name for r in net.rdma_resources}
    broken = [
        net.nvshmem is not None and spec.expert_backend != "deep_ep",
        spec.device != "cuda" and bool(net.rdma_resources),
        spec.resources.rdma_per_node > 0 and spec.resources.rdma_resource in rdma_names,
        net.nvshmem is not None and bool(net.nvshmem.hca_pe_mapping)
        and sum(m.pes for m in net.nvshmem.hca_pe_mapping) != spec.topology.gpus_per_node,
        bool(net.attachments) and MULTUS_ANNOTATION in spec.pod_template.annotations,
    ]
    for bad, (_, message) in zip(broken, SPEC_RULES):
        if bad:
            raise ValueError(message)


def ibgda(spec: "PDRolloutSpec") -> bool:
    nv = spec.network.nvshmem
    return nv.ibgda if nv is not None and nv.ibgda is not None else spec.topology.nodes > 1


def env(spec: "PDRolloutSpec") -> dict[str, str]:
    """What NCCL and NVSHMEM read: nothing on CPU (gloo binds the pod IP itself), NCCL on CUDA, NVSHMEM
    and the QP split for DeepEP. netenv holds the arithmetic the DeepEP backend shares."""
    extra = {e.name: e.value for e in spec.network.env}
    if spec.device != "cuda":
        return extra
    net, ib = spec.network, spec.network.ib
    out = netenv.nccl_env(net.ib_hcas, net.socket_ifname, ib.gid_index)
    for key, value in (("NCCL_IB_TC", ib.traffic_class), ("NCCL_IB_SL", ib.service_level),
                       ("NCCL_IB_QPS_PER_CONNECTION", ib.qps_per_connection)):
        if value is not None:
            out[key] = str(value)
    if spec.expert_backend == "deep_ep":
        nv = net.nvshmem or Nvshmem()
        out.update(netenv.nvshmem_env(nv.qps_per_rank, qp_depth=nv.qp_depth, internode=ibgda(spec),
                                      hcas=nv.hcas or net.ib_hcas, gid_index=ib.gid_index,
                                      nic_pe_mapping=bool(nv.nic_pe_mapping or nv.hca_pe_mapping)))
        for key, value in (("NVSHMEM_IB_TRAFFIC_CLASS", ib.traffic_class), ("NVSHMEM_IB_SL", ib.service_level)):
            if value is not None:
                out[key] = str(value)
        if nv.hca_pe_mapping:
            out["NVSHMEM_HCA_PE_MAPPING"] = ",".join(f"{m.hca}:{m.port}:{m.pes}" for m in nv.hca_pe_mapping)
        out["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] = net.socket_ifname   # DeepEP's unique-id bootstrap
        split = netenv.qp_split(nv.qps_per_rank)
        out[netenv.QP_RANGE_ENV["decode"]] = netenv.format_range(split.decode)
        out[netenv.QP_RANGE_ENV["prefill"]] = netenv.format_range(split.prefill)
    return {**out, **extra}   # disjoint: the models refuse an owned variable in network.env


def resources(spec: "PDRolloutSpec") -> dict[str, str]:
    """RDMA device requests (limits equal): resources.rdmaResource and every network.rdmaResources rail."""
    if spec.device != "cuda":
        return {}
    r = spec.resources
    out = {r.rdma_resource: str(r.rdma_per_node)} if r.rdma_per_node else {}
    out.update({rail.name: str(rail.count) for rail in spec.network.rdma_resources})
    return out


def apply_to_pod(tpl: dict, spec: "PDRolloutSpec") -> dict:
    """hostNetwork/hostIPC and the Multus annotation into a built pod template (only what is set)."""
    net, pod = spec.network, tpl["spec"]
    if net.host_network:
        pod["hostNetwork"] = True
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"   # else a host-network pod cannot resolve rank 0
    if net.host_ipc:
        pod["hostIPC"] = True
    if net.attachments:
        tpl["metadata"].setdefault("annotations", {})[MULTUS_ANNOTATION] = ",".join(net.attachments)
    return tpl
