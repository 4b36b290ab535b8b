"""The PDRollout resource as pydantic models: the one source of the CRD schema (see crd.py) and of the
operator's view of a resource. Field names are the CRD's camelCase; Python attributes are snake_case."""
from __future__ import annotations

import enum
import ipaddress
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from pdrollout.engine.protocol.config import SPEC_K_MAX, Activation, ControlSettings, EngineConfig, Ordering
from pdrollout.engine.protocol.layout import DEVICES, EXPERT_BACKENDS
from pdrollout.engine.protocol.metrics import TTFT_WINDOW
from pdrollout.engine.protocol.netenv import DEEP_EP_INTRANODE_RANKS as DEEP_EP_RANKS
from pdrollout.engine.protocol.topology import Topology as RankTopology
from pdrollout.operator import network as net
from pdrollout.operator.network import Network
from pdrollout.operator.storage import MODEL_VOLUME, SOURCE_VOLUME
from pdrollout.operator.podspec import ENGINE_CONTAINER, EngineSizing, EnvVar, Lifecycle, ModelSource, PodTemplateSpec
from pdrollout.operator.podspec import QUANTITY
from pdrollout.operator.podspec import _Named as _Open
from pdrollout.operator.router import Router   # a pass-through object with a checked name
from pdrollout.operator.fleet import MAX_GROUPS, GroupSummary

GROUP = "pdrollout.io"
VERSION = "v1alpha1"
PLURAL = "pdrollouts"
KIND = "PDRollout"

Dtype = Literal[get_args(EngineConfig.model_fields["dtype"].annotation)]  # the engine's own list
RestartPolicy = Literal["RecreateGroupOnPodRestart", "None"]
Device = Literal[DEVICES]                     # the engine's own lists
ExpertBackend = Literal[EXPERT_BACKENDS]
MAX_NODES = 2


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


def _rules(*rules: tuple[str, str]) -> dict:
    """CEL rules attached to a schema node: (expression, message) pairs."""
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]}


class ModelSpec(_Model):
    path: str = Field(min_length=1, description="Model directory inside the engine container.")
    dtype: Dtype = "bfloat16"
    source: ModelSource | None = Field(default=None, description=(
        "Where the model directory comes from, mounted at `path`; unset: the image has it."))


class Topology(_Model):
    model_config = ConfigDict(json_schema_extra=_rules(
        ("(self.nodes * self.gpusPerNode) % self.expertParallel == 0",
         "expertParallel must divide the world size nodes × gpusPerNode"),
        ("(self.nodes * self.gpusPerNode) % self.attentionDataParallel == 0",
         "attentionDataParallel must divide the world size nodes × gpusPerNode"),
    ))

    nodes: int = Field(default=1, ge=1, le=MAX_NODES, description="Nodes in the group (1 or 2), one pod each.")
    gpus_per_node: int = Field(default=8, ge=1, le=8)
    expert_parallel: int = Field(default=8, ge=1, le=16, description="EP width e; ETP = world/e.")
    attention_data_parallel: int = Field(default=1, ge=1, le=16, description="ADP width d; ATP = world/d.")

    @model_validator(mode="after")
    def _divides(self) -> "Topology":  # mirrors the CEL rules above
        for field, width in (("expertParallel", self.expert_parallel),
                             ("attentionDataParallel", self.attention_data_parallel)):
            if self.world_size % width:
                raise ValueError(f"{field} must divide the world size nodes × gpusPerNode")
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def ranks(self) -> RankTopology:
        """The engine's topology arithmetic (ATP = world/ADP, ETP = world/EP)."""
        return RankTopology(world=self.world_size, adp=self.attention_data_parallel, ep=self.expert_parallel)

    @property
    def attention_tp(self) -> int:
        return self.ranks.atp

    @property
    def expert_tp(self) -> int:
        return self.ranks.etp


class Multiplexing(_Model):
    """Live engine controls; pushed to every engine's /control without restarting pods."""

    activation: Activation = "auto"
    span: int | Literal["auto"] = Field(
        default="auto", json_schema_extra=_rules(
            ("type(self) == string ? self == 'auto' : (self >= 1 && self <= 4)",
             "span must be an integer 1..4 or 'auto'")))
    prefill_budget_tokens: int = Field(default=32768, ge=1)
    ordering: Ordering = "fine-grained"
    p_wait_bound_ms: float | None = Field(
        default=None, ge=1, description="pd: once the oldest request without its first token has waited this "
                                        "long, P runs whole-budget segments until it has it (unset: off).")
    p_gather_ms: float | None = Field(
        default=None, ge=1, description="pd: P below the top request priority waits up to this long to share "
                                        "one P-carrying step (unset: never).")
    p_burst_first: bool | None = Field(
        default=None, description="pd: while more requests wait for their first token than rows decode, P runs "
                                  "alone as under normal (unset: the engine's default, on with one-rank P epochs).")

    @field_validator("span")
    @classmethod
    def _span(cls, v):  # mirrors the CEL rule
        if v != "auto" and not 1 <= v <= 4:
            raise ValueError("span must be an integer 1..4 or 'auto'")
        return v

    def control(self) -> ControlSettings:
        """The engine's /control body (validated by the engine's own model)."""
        return ControlSettings(activation=self.activation, span=self.span,
                               prefill_budget_tokens=self.prefill_budget_tokens, ordering=self.ordering,
                               p_wait_bound_ms=self.p_wait_bound_ms, p_gather_ms=self.p_gather_ms,
                               p_burst_first=self.p_burst_first)


class Speculative(_Model):
    """Speculative decoding inside D (the engine's `--speculative`). Read when an engine starts:
    changing it recreates the group on the new pod template."""
    model_config = ConfigDict(json_schema_extra=_rules(
        ("self.method == 'draft' ? has(self.draftModel) : !has(self.draftModel)",
         "draftModel is set exactly when method is draft"),
    ))

    method: Literal["ngram", "draft", "mtp"] = Field(description=(
        "ngram: prompt lookup, no extra weights; draft: a small model sharing the tokenizer (draftModel); "
        "mtp: the checkpoint's own multi-token-prediction head (config num_nextn_predict_layers >= 1)."))
    k: int = Field(default=4, ge=1, le=SPEC_K_MAX, description="Draft tokens proposed per decode row.")
    draft_model: str | None = Field(default=None, min_length=1, description=(
        "method draft: the draft's model directory inside the engine container."))

    @model_validator(mode="after")
    def _draft(self) -> "Speculative":  # mirrors the CEL rule above
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("draftModel is set exactly when method is draft")
        return self

    def engine_fields(self) -> dict:
        """The EngineConfig fields (`pdrollout serve --speculative ... --speculative-k ... --draft-model`)."""
        return {"speculative": self.method, "speculative_k": self.k,
                **({"draft_model": self.draft_model} if self.draft_model else {})}


# Kubernetes' quantity syntax (the API server's own message quotes it): checked at admission, since a
# bad quantity in a built StatefulSet is only refused later, as an HTTP 500 on apply.


class Resources(_Model):
    cpu: str = Field(default="16", min_length=1, pattern=QUANTITY)
    memory: str = Field(default="128Gi", min_length=1, pattern=QUANTITY)
    shared_memory: str = Field(default="32Gi", min_length=1, pattern=QUANTITY,
                               description="Size of the /dev/shm tmpfs.")
    rdma_resource: str = Field(default="rdma/ib", min_length=1)
    rdma_per_node: int = Field(default=1, ge=0, description="0: request no RDMA device.")


# What the operator itself sets in the pod; podTemplate may not set these (the operator's win).
RESERVED_ENV = ("POD_NAME", "POD_IP")
RESERVED_ENV_PREFIXES = ("PDROLLOUT_", "NCCL_", "NVSHMEM_")
RESERVED_VOLUMES = ("dshm", "config", "admin", MODEL_VOLUME, SOURCE_VOLUME)
RESERVED_MOUNTS = ("/dev/shm", "/etc/pdrollout", "/var/run/secrets/pdrollout")
_ENV_MSG = ("podTemplate.env may not set " + ", ".join(RESERVED_ENV) + " or "
            + ", ".join(p + "*" for p in RESERVED_ENV_PREFIXES) + " (the operator sets them)")
_VOL_MSG = "podTemplate.volumes may not use the names " + ", ".join(RESERVED_VOLUMES) + " (the operator's)"
_MOUNT_MSG = "podTemplate.volumeMounts may not mount at " + ", ".join(RESERVED_MOUNTS) + " (the operator's)"
_TEMPLATE_ENGINE_MSG = ("podTemplate.template.spec.containers[name=engine] may not set the env "
                        + ", ".join(RESERVED_ENV) + ", " + ", ".join(p + "*" for p in RESERVED_ENV_PREFIXES)
                        + " nor mount at " + ", ".join(RESERVED_MOUNTS) + " (the operator's: rank env, "
                        "layout and token mounts)")
_PASS = {"x-kubernetes-preserve-unknown-fields": True}   # a Kubernetes object, checked by the API server
MAX_ITEMS = 64


def _cel_list(values) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


class Volume(_Open):
    pass


class VolumeMount(_Model):
    name: str = Field(min_length=1, max_length=253)
    mount_path: str = Field(min_length=1, max_length=4096)
    read_only: bool | None = None
    sub_path: str | None = Field(default=None, max_length=4096)


class LocalObjectReference(_Model):
    name: str = Field(min_length=1, max_length=253)


class PodTemplate(_Model):
    """Pod settings a platform needs (placement, pulls, extra env and volumes), merged into the pods the
    operator builds; the operator's own fields win (reserved names are refused)."""

    annotations: dict[str, str] = Field(default={}, description="Added to the pods' annotations.")
    node_selector: dict[str, str] = Field(default={})
    affinity: dict[str, Any] | None = Field(default=None, json_schema_extra=_PASS, description=(
        "nodeAffinity/podAffinity as written; podAntiAffinity terms are added to the operator's exclusive "
        "placement term."))
    tolerations: list[dict[str, Any]] = Field(default=[], max_length=MAX_ITEMS, json_schema_extra={
        "items": {"type": "object", **_PASS}}, description="Added to the operator's (the GPU taint's).")
    image_pull_secrets: list[LocalObjectReference] = Field(default=[], max_length=MAX_ITEMS)
    priority_class_name: str | None = Field(default=None, max_length=253)
    env: list[EnvVar] = Field(default=[], max_length=MAX_ITEMS, json_schema_extra=_rules(
        (f"self.all(e, !(e.name in {_cel_list(RESERVED_ENV)}) && "
         + " && ".join(f"!e.name.startsWith('{p}')" for p in RESERVED_ENV_PREFIXES) + ")", _ENV_MSG)))
    volumes: list[Volume] = Field(default=[], max_length=MAX_ITEMS, json_schema_extra=_rules(
        (f"self.all(v, !(v.name in {_cel_list(RESERVED_VOLUMES)}))", _VOL_MSG)))
    volume_mounts: list[VolumeMount] = Field(default=[], max_length=MAX_ITEMS, json_schema_extra=_rules(
        (f"self.all(m, !(m.mountPath in {_cel_list(RESERVED_MOUNTS)}))", _MOUNT_MSG)))
    template: PodTemplateSpec | None = Field(default=None, json_schema_extra=_rules(
        (f"!has(self.spec.volumes) || self.spec.volumes.all(v, !(v.name in {_cel_list(RESERVED_VOLUMES)}))",
         _VOL_MSG.replace("podTemplate.volumes", "podTemplate.template.spec.volumes")),
        (f"!has(self.spec.containers) || self.spec.containers.all(c, c.name != '{ENGINE_CONTAINER}' || "
         f"((!has(c.env) || c.env.all(e, !(e.name in {_cel_list(RESERVED_ENV)}) && "
         + " && ".join(f"!e.name.startsWith('{p}')" for p in RESERVED_ENV_PREFIXES) + ")) && "
         f"(!has(c.volumeMounts) || c.volumeMounts.all(m, !(m.mountPath in {_cel_list(RESERVED_MOUNTS)})))))",
         _TEMPLATE_ENGINE_MSG)), description=(
        "A full PodTemplateSpec (runtimeClassName, schedulerName, securityContext, initContainers, sidecars, "
        "volumes...), merged under the operator's fields; a container named engine adds to the engine's."))

    @model_validator(mode="after")
    def _reserved(self) -> "PodTemplate":  # mirrors the CEL rules above
        if any(e.name in RESERVED_ENV or e.name.startswith(RESERVED_ENV_PREFIXES) for e in self.env):
            raise ValueError(_ENV_MSG)
        if any(v.name in RESERVED_VOLUMES for v in self.volumes):
            raise ValueError(_VOL_MSG)
        if any(m.mount_path in RESERVED_MOUNTS for m in self.volume_mounts):
            raise ValueError(_MOUNT_MSG)
        t = self.template
        if t and any(v.name in RESERVED_VOLUMES for v in t.spec.volumes):
            raise ValueError(_VOL_MSG.replace("podTemplate.volumes", "podTemplate.template.spec.volumes"))
        for c in (t.spec.containers if t else []):
            if c.name == ENGINE_CONTAINER and (
                    any(e.name in RESERVED_ENV or e.name.startswith(RESERVED_ENV_PREFIXES) for e in c.env)
                    or any(m.mount_path in RESERVED_MOUNTS for m in c.volume_mounts)):
                raise ValueError(_TEMPLATE_ENGINE_MSG)
        return self


class Gang(_Model):
    """All-or-nothing scheduling through the coscheduling plugin of kubernetes-sigs/scheduler-plugins: a
    PodGroup with minMember = nodes, the pods labelled into it and handed to that scheduler."""

    scheduler_name: str = Field(default="scheduler-plugins-scheduler", min_length=1, max_length=253,
                                description="The profile of a kube-scheduler that runs the Coscheduling plugin.")
    schedule_timeout_seconds: int = Field(default=300, ge=1, description=(
        "How long placed pods wait (unbound, holding nothing) for the rest of the group."))


# A qualified label key (an optional DNS-subdomain prefix and a name), as Kubernetes validates one.
_LABEL_KEY = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"


class Placement(_Model):
    topology_key: str | None = Field(default=None, max_length=316, pattern=_LABEL_KEY, description=(
        "A node label key (e.g. a rack or spine label): all of the group's pods go to nodes with one value "
        "of it. Unset: anywhere (still one pod of the group per node)."))


class IPBlock(_Model):
    model_config = ConfigDict(json_schema_extra=_rules(("isCIDR(self.cidr)", "ipBlock.cidr must be a CIDR network")))

    cidr: str = Field(min_length=1, max_length=64, description="An IPv4 or IPv6 network, e.g. 10.1.0.0/16.")
    except_: list[str] = Field(default=[], alias="except", max_length=MAX_ITEMS)

    @field_validator("cidr")
    @classmethod
    def _network(cls, v: str) -> str:
        try:
            ipaddress.ip_network(v, strict=False)   # as CEL isCIDR
        except ValueError as e:
            raise ValueError(f"{v!r} is not a CIDR network ({e})") from None
        return v


class Peer(_Model):
    """A NetworkPolicy peer: an ipBlock, or pod and/or namespace selectors (label selectors)."""
    model_config = ConfigDict(json_schema_extra=_rules(
        ("has(self.ipBlock) != (has(self.podSelector) || has(self.namespaceSelector))",
         "a peer is an ipBlock, or podSelector and/or namespaceSelector (not both kinds, not none)")))
    ip_block: IPBlock | None = None
    pod_selector: dict[str, Any] | None = Field(default=None, json_schema_extra=_PASS)
    namespace_selector: dict[str, Any] | None = Field(default=None, json_schema_extra=_PASS)

    @model_validator(mode="after")
    def _one_kind(self) -> "Peer":
        if self.ip_block is not None and (self.pod_selector is not None or self.namespace_selector is not None):
            raise ValueError("a peer is an ipBlock or selectors, not both")
        if self.ip_block is None and self.pod_selector is None and self.namespace_selector is None:
            raise ValueError("a peer needs ipBlock, podSelector or namespaceSelector")
        return self


class Access(_Model):
    trainer_peers: list[Peer] = Field(default=[], max_length=MAX_ITEMS, description=(
        "Trainers that sync weights into the engines: every port (NCCL's are ephemeral) from these peers; "
        "the CIDRs of their ipBlocks may also use the admin routes without the token (--admin-peers)."))
    metrics_peers: list[Peer] | None = Field(default=None, max_length=MAX_ITEMS, description=(
        "Who may scrape the HTTP port from other namespaces. Unset: namespaces labelled "
        "pdrollout.io/metrics-access=true."))


_DEEP_EP_RANKS_CEL = "[" + ", ".join(map(str, DEEP_EP_RANKS)) + "]"
_DEEP_EP_MSG = (f"expertBackend deep_ep runs on one node with expertParallel in "
                f"{', '.join(map(str, DEEP_EP_RANKS))} (stock DeepEP's intranode kernels)")


_RDMA_MSG = "a two-node rollout needs resources.rdmaPerNode > 0 or network.rdmaResources (RDMA devices)"


class PDRolloutSpec(_Model):
    model_config = ConfigDict(json_schema_extra=_rules(
        ("self.device == 'cpu' || self.topology.nodes == 1 || size(self.network.ibHCAs) > 0",
         "a two-node rollout needs network.ibHCAs (the nodes talk over RDMA)"),
        ("self.device == 'cpu' || self.topology.nodes == 1 || self.resources.rdmaPerNode > 0 || "
         "size(self.network.rdmaResources) > 0", _RDMA_MSG),
        ("self.expertBackend != 'deep_ep' || self.device == 'cuda'", "expertBackend deep_ep needs device cuda"),
        (f"self.expertBackend != 'deep_ep' || (self.topology.nodes == 1 && "
         f"self.topology.expertParallel in {_DEEP_EP_RANKS_CEL})", _DEEP_EP_MSG),
        *net.SPEC_RULES,
    ))

    image: str = Field(min_length=1)
    model: ModelSpec
    device: Device = Field(default="cuda", description="cuda: one rank per GPU; cpu: gpusPerNode CPU ranks per "
                                                       "pod over gloo (no GPUs, no RDMA requested).")
    expert_backend: ExpertBackend = Field(default="torch", description="Expert all-to-all of the multi-rank "
                                                                        "engine: torch (NCCL/gloo) or deep_ep.")
    topology: Topology = Field(default_factory=Topology)
    multiplexing: Multiplexing = Field(default_factory=Multiplexing)
    speculative: Speculative | None = Field(default=None, description="Speculative decoding inside D; "
                                                                      "unset: off.")
    network: Network = Field(default_factory=Network)
    resources: Resources = Field(default_factory=Resources)
    port: int = Field(default=30000, ge=1024, le=65535, description="Engine HTTP port.")
    restart_policy: RestartPolicy = "RecreateGroupOnPodRestart"
    pod_template: PodTemplate = Field(default_factory=PodTemplate)
    engine: EngineSizing = Field(default_factory=EngineSizing, description="Engine sizes read at start.")
    lifecycle: Lifecycle = Field(default_factory=Lifecycle, description="Start, liveness and drain bounds.")
    placement: Placement = Field(default_factory=Placement)
    access: Access = Field(default_factory=Access)
    gang: Gang | None = Field(default=None, description="Gang scheduling (needs scheduler-plugins' "
                                                        "coscheduling and its PodGroup CRD); unset: the default scheduler.")
    router: Router | None = Field(default=None, description="sglang-router in front of the API pods; the client "
                                                            "Service points at it. Unset: at node 0.")
    replicas: int | None = Field(default=None, ge=0, le=MAX_GROUPS, description=(
        "Engine groups: child PDRollouts NAME-0..NAME-(N-1), each a whole group. Unset: this is one group."))
    max_unavailable_groups: int | None = Field(default=None, ge=1, description=(
        "With replicas: groups a spec change may take down at once (default 1)."))

    @model_validator(mode="before")
    @classmethod
    def _stored_before_issue_52(cls, data):
        return net.drop_legacy_default(data)

    @model_validator(mode="after")
    def _runnable(self) -> "PDRolloutSpec":  # mirrors the CEL rules above
        rdma = self.device == "cuda" and self.topology.nodes > 1
        if rdma and not self.network.ib_hcas:
            raise ValueError("a two-node rollout needs network.ibHCAs (the nodes talk over RDMA)")
        if rdma and self.resources.rdma_per_node < 1 and not self.network.rdma_resources:
            raise ValueError(_RDMA_MSG)
        if self.expert_backend == "deep_ep" and self.device != "cuda":
            raise ValueError("expertBackend deep_ep needs device cuda")
        if self.expert_backend == "deep_ep" and (self.topology.nodes != 1
                                                 or self.topology.expert_parallel not in DEEP_EP_RANKS):
            raise ValueError(_DEEP_EP_MSG)
        net.check_spec(self)
        return self


class Phase(str, enum.Enum):
    STARTING = "Starting"        # pods not all ready yet
    RUNNING = "Running"          # every pod ready and rank 0 healthy
    DEGRADED = "Degraded"        # pods ready but the engine unhealthy or unreachable
    RESTARTING = "Restarting"    # the whole group is being recreated (or waits out its backoff)
    FAILED = "Failed"            # an object built from the spec was refused (InvalidSpec says why)
    UPDATING = "Updating"        # the pod template changed: the group is recreated on the new one


class ConditionType(str, enum.Enum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    STALLED = "Stalled"
    INVALID_SPEC = "InvalidSpec"  # the API server refused an object built from the spec
    CONFIG_ERROR = "ConfigError"  # an engine (or the model cache's fill) exited with the config code


class Condition(_Model):
    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(min_length=1)
    message: str = ""
    last_transition_time: str | None = None


class PDRolloutStatus(_Model):
    phase: Phase | None = None
    observed_generation: int | None = None
    ready_nodes: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    makespan_seconds: float | None = None
    recent_ttft_p99_seconds: float | None = Field(default=None, description="p99 time to first token of node 0's "
                                                  f"last {TTFT_WINDOW} requests, from the engine's own records "
                                                  "(seconds).")
    mean_decode_wait_seconds: float | None = None
    stalls: int | None = Field(default=None, description="Engine exits with the stall code seen by the operator.")
    last_stall_time: str | None = None
    last_stall_exit: str | None = Field(default=None, description="The stall exit counted last (pod UID/restarts/"
                                                                  "finish time).")
    group_restarts: int | None = None
    group_updates: int | None = Field(default=None, description="Group recreations for a pod template change.")
    updating_to: str | None = Field(default=None, description="Template hash the group is being updated to; "
                                                              "cleared once every pod on it is ready.")
    restart_streak: int | None = Field(default=None, description="Group restarts since last Running.")
    group_pods: dict[str, str] | None = Field(default=None, description="Pod UIDs of the current incarnation.")
    last_group_restart_time: str | None = None
    control: Multiplexing | None = Field(default=None, description="Controls last applied to the engines.")
    replicas: int | None = Field(default=None, description="With spec.replicas: the groups there are.")
    ready_groups: int | None = Field(default=None, description="Groups whose pods are all ready on their spec.")
    selector: str | None = Field(default=None, description="The fleet's pods (the scale subresource's).")
    groups: list[GroupSummary] | None = None
    weight_version: str | None = Field(default=None, description="The weight version node 0's engine reports "
                                                                 "(GET /get_weight_version; set by the trainer's "
                                                                 "weight updates).")
