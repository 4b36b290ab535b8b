"""Pure builders: a PDRollout (name, namespace, spec) -> the objects that run it. No I/O here; the
handlers adopt (owner references) and apply what these return."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os

from pdrollout.engine.protocol.config import EngineConfig
from pdrollout.engine.protocol.auth import ADMIN_TOKEN_FILE_ENV
from pdrollout.engine.protocol.layout import LAYOUT_FILE_ENV, GroupLayout
from pdrollout.operator import network
from pdrollout.operator import podtemplate
from pdrollout.operator import access, placement, router
from pdrollout.operator.models import MAX_NODES, PDRolloutSpec

ENGINE_CONTAINER = "engine"
DIST_PORT = 29500                  # torch.distributed rendezvous on rank 0
CONFIG_DIR = "/etc/pdrollout"
ENGINE_CONFIG_KEY = "engine-config.json"
ROLLOUT_INFO_KEY = "rollout.json"
CLUSTER_DOMAIN_ENV = "PDROLLOUT_OPERATOR_CLUSTER_DOMAIN"
# The cluster's DNS domain (kubelet --cluster-domain): node 0's name in the layout ends in it.
CLUSTER_DOMAIN = os.environ.get(CLUSTER_DOMAIN_ENV) or "cluster.local"
LABEL_ROLLOUT = "pdrollout.io/rollout"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"  # set by the StatefulSet controller on each pod
MANAGED_BY = "pdrollout-operator"
ADMIN_DIR = "/var/run/secrets/pdrollout"   # the admin token Secret's mount (not under CONFIG_DIR)
ADMIN_TOKEN_KEY = "token"
# The operator's pods, as the NetworkPolicies name them (the chart sets this label on them).
OPERATOR_POD_LABELS = {"pdrollout.io/component": "operator"}
METRICS_ACCESS_LABEL = access.METRICS_ACCESS_LABEL
POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"   # scheduler-plugins' coscheduling
TEMPLATE_HASH = "pdrollout.io/template-hash"   # pod annotation: which template a pod was made from
# pod annotation: the engine's start-time config (ConfigMap) it was made for; part of the template hash
ENGINE_CONFIG_HASH = "pdrollout.io/engine-config-hash"
ENGINE_UID = 65532   # non-root user for CPU engine pods (the images have no passwd entry: numeric only)


def labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pdrollout-engine",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_ROLLOUT: name,
    }


def service_name(name: str) -> str:
    return name  # headless; pods resolve as <name>-<i>.<name>.<ns>.svc


def api_service_name(name: str) -> str:
    return f"{name}-api"  # clients: node 0 only (the other nodes serve no API)


def configmap_name(name: str) -> str:
    return f"{name}-engine"


def admin_secret_name(name: str) -> str:
    return f"{name}-admin"


def admin_token(key: bytes, namespace: str, name: str, uid: str) -> str:
    """The engines' admin bearer token for one rollout, derived from the operator's key: the operator
    never needs to read Secrets back (no `get secrets`), a restarted operator knows every token, and a
    rollout recreated under the same name (new UID) gets a new one."""
    return hmac.new(key, f"{namespace}/{name}/{uid}".encode(), hashlib.sha256).hexdigest()


DNS_LABEL_MAX = 63
# The StatefulSet controller labels each pod `controller-revision-hash: <statefulset>-<hash>`; the hash
# is up to 10 characters and a label value at most 63, so this suffix bounds the StatefulSet's name.
REVISION_HASH_SUFFIX = "-" + "h" * 10


def derived_names(name: str) -> list[str]:
    """Every name built from the rollout's that must be a DNS-1035 label (Services) or fit one (the
    pods' hostnames, the revision-hash label)."""
    return [service_name(name), api_service_name(name), configmap_name(name), admin_secret_name(name),
            name + REVISION_HASH_SUFFIX,
            *(f"{name}-{i}" for i in range(MAX_NODES))]


def max_name_length() -> int:
    """The longest rollout name whose derived names all fit a DNS label (52)."""
    return DNS_LABEL_MAX - max(len(n) for n in derived_names(""))


NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"   # DNS-1035: a Service name must start with a letter


def master_address(name: str, namespace: str) -> str:
    """Rank 0's stable DNS name through the headless Service."""
    return f"{name}-0.{service_name(name)}.{namespace}.svc.{CLUSTER_DOMAIN}"


def _var(key: str, value: str) -> dict:
    return {"name": key, "value": value}


def _field(key: str, path: str) -> dict:
    return {"name": key, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def network_env(spec: PDRolloutSpec) -> dict[str, str]:
    """What NCCL and NVSHMEM read (operator/network.py renders spec.network)."""
    return network.env(spec)


def engine_env(name: str, namespace: str, spec: PDRolloutSpec) -> list[dict]:
    """Container env: the pod-specific node rank and address, where the shared layout file is, and
    the network settings. The layout itself is in the file (one source of truth for every pod).
    Multiplexing is absent on purpose: it changes live through /control, and a template change
    would restart the pods."""
    # CPU pods run as ENGINE_UID, which has no passwd entry in the image: torch asks getpass for a user
    # name (inductor's cache dir, at import) and Python's ~ needs HOME, so both come from the env.
    identity = [] if spec.device == "cuda" else [_var("USER", "pdrollout"), _var("HOME", "/tmp")]
    return [
        *identity,
        _field("PDROLLOUT_NODE_RANK", f"metadata.labels['{POD_INDEX_LABEL}']"),
        _field("POD_NAME", "metadata.name"),
        _field("POD_IP", "status.podIP"),
        _var(LAYOUT_FILE_ENV, f"{CONFIG_DIR}/{ROLLOUT_INFO_KEY}"),
        _var(ADMIN_TOKEN_FILE_ENV, f"{ADMIN_DIR}/{ADMIN_TOKEN_KEY}"),
        *(_var(k, v) for k, v in network_env(spec).items()),
    ]


def engine_args(spec: PDRolloutSpec) -> list[str]:
    """The same `pdrollout serve` in every pod; the layout comes from $PDROLLOUT_ROLLOUT_INFO.
    Every listener binds the pod's own address (two pods on one host never collide)."""
    return ["serve", "--model", spec.model.path, "--host", "$(POD_IP)", "--port", str(spec.port),
            "--mode", "pd", "--engine-config", f"{CONFIG_DIR}/{ENGINE_CONFIG_KEY}",
            "--drain-timeout", str(spec.lifecycle.drain_seconds),
            *access.admin_peer_args(spec.access)]


def engine_config(spec: PDRolloutSpec) -> dict:
    """Extra EngineConfig fields for `pdrollout serve --engine-config`, including the controls an
    engine starts with (so a restarted pod comes up with the current spec.multiplexing)."""
    cfg = {"dtype": spec.model.dtype, "control": spec.multiplexing.control().model_dump(),
           **spec.engine.engine_fields()}
    # The engine must accept it. kv_mem_fraction is the CUDA KV sizing's field (kv52): checked here once
    # the engine has it; until then by the CRD's range only.
    known = {k: v for k, v in cfg.items() if k != "kv_mem_fraction" or k in EngineConfig.model_fields}
    EngineConfig.model_validate({"model": spec.model.path, **known})
    # Not validated here: the engine checks them against the checkpoints (an MTP head, the draft's
    # vocabulary), which only the pods can read; a mismatch ends the engine with the config exit code.
    return {**cfg, **(spec.speculative.engine_fields() if spec.speculative else {})}


def engine_start_digest(name: str, namespace: str, spec: PDRolloutSpec) -> str:
    """What an engine reads from its ConfigMap only when it starts: all of engine_config but the live
    controls, and the mounted layout (rollout.json: nodes, EP, ADP...). A change must reach the pods by
    recreating the group, as a changed template does; the layout left out, an EP/ADP/node-count change
    moved the ConfigMap while the engines kept the old layout."""
    start = {k: v for k, v in engine_config(spec).items() if k != "control"}
    start["layout"] = rollout_info(name, namespace, spec)
    return hashlib.sha256(json.dumps(start, sort_keys=True).encode()).hexdigest()[:16]


def group_layout(name: str, namespace: str, spec: PDRolloutSpec) -> GroupLayout:
    """The engine's layout of this rollout (node rank 0: the shared file has no pod-specific field)."""
    t = spec.topology
    return GroupLayout(nnodes=t.nodes, nproc_per_node=t.gpus_per_node, master_addr=master_address(name, namespace),
                       master_port=DIST_PORT, adp=t.attention_data_parallel, ep=t.expert_parallel,
                       device=spec.device, expert_backend=spec.expert_backend)


def rollout_info(name: str, namespace: str, spec: PDRolloutSpec) -> dict:
    """`rollout.json`: the layout every pod's engine reads (the engine's own keys), plus derived
    figures for humans."""
    t = spec.topology
    return {**group_layout(name, namespace, spec).to_file(), "rollout": name, "worldSize": t.world_size,
            "attentionTP": t.attention_tp, "expertTP": t.expert_tp}


def configmap(name: str, namespace: str, spec: PDRolloutSpec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": configmap_name(name), "namespace": namespace, "labels": labels(name)},
        "data": {
            ENGINE_CONFIG_KEY: json.dumps(engine_config(spec), indent=2, sort_keys=True),
            ROLLOUT_INFO_KEY: json.dumps(rollout_info(name, namespace, spec), indent=2, sort_keys=True),
        },
    }


def service(name: str, namespace: str, spec: PDRolloutSpec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service_name(name), "namespace": namespace, "labels": labels(name)},
        "spec": {
            "clusterIP": "None",
            "selector": {LABEL_ROLLOUT: name},
            # Peers must resolve rank 0 before it is ready: readiness needs the group.
            "publishNotReadyAddresses": True,
            "ports": [
                {"name": "http", "port": spec.port, "targetPort": "http"},
                {"name": "dist", "port": DIST_PORT, "targetPort": "dist"},
            ],
        },
    }


def api_selector(name: str) -> dict[str, str]:
    return router.worker_selector(name, LABEL_ROLLOUT, POD_INDEX_LABEL)


def api_service(name: str, namespace: str, spec: PDRolloutSpec) -> dict:
    """The client Service: node 0 alone (it plans and serves the API for the whole group), or the router."""
    selector = {router.LABEL_ROUTER: name} if spec.router else api_selector(name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": api_service_name(name), "namespace": namespace, "labels": labels(name)},
        "spec": {
            "selector": selector,
            "ports": [{"name": "http", "port": spec.port, "targetPort": "http"}],
        },
    }


def admin_secret(name: str, namespace: str, token: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": admin_secret_name(name), "namespace": namespace, "labels": labels(name)},
        "type": "Opaque",
        "data": {ADMIN_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def network_policy(name: str, namespace: str, spec: PDRolloutSpec, operator_namespace: str) -> dict:
    """Ingress to the rollout's pods: anything from the rollout's own pods (torch.distributed and NCCL
    use ephemeral ports besides `dist`), the HTTP port from the operator, from pods of this namespace and
    from namespaces labelled for metrics access. Enforced only by a CNI that implements NetworkPolicy."""
    http = [{"protocol": "TCP", "port": spec.port}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
        "spec": {
            "podSelector": {"matchLabels": {LABEL_ROLLOUT: name}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {LABEL_ROLLOUT: name}}}]},
                {"from": [{"namespaceSelector": {"matchLabels": {
                              "kubernetes.io/metadata.name": operator_namespace}},
                           "podSelector": {"matchLabels": OPERATOR_POD_LABELS}},
                          {"podSelector": {}},
                          *access.metrics_peers(spec.access)],
                 "ports": http},
                *access.trainer_rules(spec.access),
            ],
        },
    }


def pod_group(name: str, namespace: str, spec: PDRolloutSpec) -> dict:
    """scheduler-plugins' PodGroup: no pod of the group binds until all `nodes` of them can."""
    return {
        "apiVersion": "scheduling.x-k8s.io/v1alpha1",
        "kind": "PodGroup",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
        "spec": {"minMember": spec.topology.nodes, "scheduleTimeoutSeconds": spec.gang.schedule_timeout_seconds},
    }


def _security(spec: PDRolloutSpec) -> tuple[dict, dict]:
    """(pod, container) securityContext. CPU pods run as a non-root user with no capabilities. CUDA pods
    keep the image's root user with IPC_LOCK: NVSHMEM/IB pin memory, and a capability added for a
    non-root user is not effective (no ambient capabilities in Kubernetes)."""
    pod = {"seccompProfile": {"type": "RuntimeDefault"}}
    ctr = {"allowPrivilegeEscalation": False}
    if spec.device == "cuda":
        ctr["capabilities"] = {"add": ["IPC_LOCK"]}
    else:
        pod.update(runAsNonRoot=True, runAsUser=ENGINE_UID, runAsGroup=ENGINE_UID, fsGroup=ENGINE_UID)
        ctr["capabilities"] = {"drop": ["ALL"]}
    return pod, ctr


def _resources(spec: PDRolloutSpec) -> dict:
    r = spec.resources
    amounts = {"cpu": r.cpu, "memory": r.memory}
    if spec.device == "cuda":   # on CPU gpusPerNode counts processes, not devices
        amounts["nvidia.com/gpu"] = str(spec.topology.gpus_per_node)
        amounts.update(network.resources(spec))
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _merge_overrides(tpl: dict, spec: PDRolloutSpec) -> dict:
    """spec.podTemplate into the built pod template. Only keys the user set appear (an empty podTemplate
    changes nothing); the operator's own env, volumes and mounts cannot be replaced (the CRD refuses
    reserved names) and its exclusive-placement term stays."""
    o = spec.pod_template
    pod, ctr = tpl["spec"], tpl["spec"]["containers"][0]
    if o.annotations:
        tpl["metadata"]["annotations"] = dict(o.annotations)
    if o.node_selector:
        pod["nodeSelector"] = dict(o.node_selector)
    if o.affinity:
        affinity = {k: v for k, v in o.affinity.items() if k != "podAntiAffinity"}
        anti = dict(o.affinity.get("podAntiAffinity") or {})
        ours = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        anti["requiredDuringSchedulingIgnoredDuringExecution"] = \
            ours + list(anti.get("requiredDuringSchedulingIgnoredDuringExecution") or [])
        if "podAffinity" in pod["affinity"]:   # placement.topologyKey's term stays too
            together = dict(affinity.get("podAffinity") or {})
            together["requiredDuringSchedulingIgnoredDuringExecution"] = \
                pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] + \
                list(together.get("requiredDuringSchedulingIgnoredDuringExecution") or [])
            affinity["podAffinity"] = together
        pod["affinity"] = {**affinity, "podAntiAffinity": anti}
    if o.tolerations:
        pod["tolerations"] = pod.get("tolerations", []) + list(o.tolerations)
    if o.image_pull_secrets:
        pod["imagePullSecrets"] = [r.model_dump() for r in o.image_pull_secrets]
    if o.priority_class_name:
        pod["priorityClassName"] = o.priority_class_name
    ctr["env"] += [e.model_dump(by_alias=True, exclude_none=True) for e in o.env]
    pod["volumes"] += [v.model_dump(by_alias=True, exclude_none=True) for v in o.volumes]
    ctr["volumeMounts"] += [m.model_dump(by_alias=True, exclude_none=True) for m in o.volume_mounts]
    return tpl


def pod_template(name: str, namespace: str, spec: PDRolloutSpec) -> dict:
    """The pods' template, annotated with a hash of itself: the operator tells pods of an older template
    by it (the StatefulSet uses OnDelete, so the operator decides when pods change)."""
    # the user's full template goes under everything the operator set (network fields included)
    tpl = podtemplate.merge_template(network.apply_to_pod(_pod_template(name, namespace, spec), spec),
                                     spec.pod_template.template)
    if spec.gang:   # the PodGroup's scheduler places the pods, all or none
        tpl["metadata"]["labels"][POD_GROUP_LABEL] = name
        tpl["spec"]["schedulerName"] = spec.gang.scheduler_name
    tpl["metadata"].setdefault("annotations", {})[ENGINE_CONFIG_HASH] = engine_start_digest(name, namespace, spec)
    digest = hashlib.sha256(json.dumps(tpl, sort_keys=True).encode()).hexdigest()[:16]
    tpl["metadata"].setdefault("annotations", {})[TEMPLATE_HASH] = digest
    return tpl


def template_hash(name: str, namespace: str, spec: PDRolloutSpec) -> str:
    return pod_template(name, namespace, spec)["metadata"]["annotations"][TEMPLATE_HASH]


def _pod_template(name: str, namespace: str, spec: PDRolloutSpec) -> dict:
    pod_security, container_security = _security(spec)
    return _merge_overrides(podtemplate.own({
        "metadata": {"labels": labels(name)},
        "spec": {
            # The engine never calls the Kubernetes API: no token in the pod.
            "automountServiceAccountToken": False,
            # The pause container is PID 1, not the engine: the kernel drops a signal to a PID 1 that has no
            # handler for it, so a pod deleted in the engine's first seconds (imports, before its handlers)
            # ran on for the whole grace period and joined the group's next start by node 0's stable name.
            "shareProcessNamespace": True,
            "securityContext": pod_security,
            "containers": [{
                "name": ENGINE_CONTAINER,
                "image": spec.image,
                "command": ["pdrollout"],
                "args": engine_args(spec),
                "env": engine_env(name, namespace, spec),
                "ports": [{"name": "http", "containerPort": spec.port},
                          {"name": "dist", "containerPort": DIST_PORT}],
                "readinessProbe": {"httpGet": {"path": "/health", "port": "http"},
                                   "periodSeconds": 5, "failureThreshold": 3},
                "resources": _resources(spec),
                "securityContext": container_security,
                "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                                 {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                                 {"name": "admin", "mountPath": ADMIN_DIR, "readOnly": True}],
            }],
            "volumes": [
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shared_memory}},
                {"name": "config", "configMap": {"name": configmap_name(name)}},
                # 0440 + fsGroup: readable by the engine's group only.
                {"name": "admin", "secret": {"secretName": admin_secret_name(name), "defaultMode": 0o440}},
            ],
            "affinity": placement.affinity(LABEL_ROLLOUT, name, spec),
            **({"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}
               if spec.device == "cuda" else {}),
        },
    }, spec), spec)


def statefulset(name: str, namespace: str, spec: PDRolloutSpec) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
        "spec": {
            "replicas": spec.topology.nodes,
            "serviceName": service_name(name),
            # The group starts together; ordered start would deadlock rank 0 waiting for its peers.
            "podManagementPolicy": "Parallel",
            # The operator replaces the pods of a changed template as one group (all ranks rendezvous
            # together); a rolling update pod by pod would break the group once per pod.
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": {LABEL_ROLLOUT: name}},
            "template": pod_template(name, namespace, spec),
        },
    }


def desired_objects(name: str, namespace: str, spec: PDRolloutSpec, token: str,
                    operator_namespace: str) -> list[dict]:
    """In apply order: the token, the policy, the config and the Services exist before any pod needs them."""
    return [admin_secret(name, namespace, token), network_policy(name, namespace, spec, operator_namespace),
            configmap(name, namespace, spec), service(name, namespace, spec), api_service(name, namespace, spec),
            *([pod_group(name, namespace, spec)] if spec.gang else []), statefulset(name, namespace, spec),
            *(router.objects(name, namespace, spec.router, spec.port, api_selector(name)) if spec.router else [])]
