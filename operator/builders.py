"""Pure builders: a PDRollout (name, namespace, spec) -> the objects that run it. No I/O here; the
handlers adopt (owner references) and apply what these return."""
from __future__ import annotations

import json

from pdrollout.engine.config import EngineConfig
from pdrollout.engine.distributed import netenv
from pdrollout.operator.models import PDRolloutSpec

ENGINE_CONTAINER = "engine"
DIST_PORT = 29500                  # torch.distributed rendezvous on rank 0
CONFIG_DIR = "/etc/pdrollout"
ENGINE_CONFIG_KEY = "engine-config.json"
ROLLOUT_INFO_KEY = "rollout.json"
CLUSTER_DOMAIN = "cluster.local"
LABEL_ROLLOUT = "pdrollout.io/rollout"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"  # set by the StatefulSet controller on each pod
MANAGED_BY = "pdrollout-operator"


def labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pdrollout-engine",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_ROLLOUT: name,
    }


def service_name(name: str) -> str:
    return name  # headless; pods resolve as <name>-<i>.<name>.<ns>.svc


def configmap_name(name: str) -> str:
    return f"{name}-engine"


def master_address(name: str, namespace: str) -> str:
    """Rank 0's stable DNS name through the headless Service."""
    return f"{name}-0.{service_name(name)}.{namespace}.svc.{CLUSTER_DOMAIN}"


def _var(key: str, value: str) -> dict:
    return {"name": key, "value": value}


def _field(key: str, path: str) -> dict:
    return {"name": key, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _range(r: range) -> str:
    return f"{r.start}:{r.stop}"  # half-open, as the engine reads PDROLLOUT_QP_RANGE_*


def network_env(spec: PDRolloutSpec) -> dict[str, str]:
    """NCCL/NVSHMEM settings from the engine's own arithmetic (pdrollout.engine.distributed.netenv),
    so the operator and the DeepEP backend cannot disagree. IBGDA runs between nodes; `ibgda: false`
    turns it off there too (IBRC)."""
    net, nodes = spec.network, spec.topology.nodes
    nv = net.nvshmem
    env = netenv.nvshmem_env(nv.qps_per_rank, qp_depth=nv.qp_depth, internode=nodes > 1, hcas=net.ib_hcas)
    if not nv.ibgda:
        env["NVSHMEM_IB_ENABLE_IBGDA"] = "0"
    env.update(netenv.nccl_env(net.ib_hcas, net.socket_ifname))
    env["GLOO_SOCKET_IFNAME"] = net.socket_ifname
    split = netenv.qp_split(nv.qps_per_rank)
    env["PDROLLOUT_QP_RANGE_D"] = _range(split.decode)
    env["PDROLLOUT_QP_RANGE_P"] = _range(split.prefill)
    return env


def engine_env(name: str, namespace: str, spec: PDRolloutSpec) -> list[dict]:
    """Container env, all derived from the topology and network spec. Multiplexing is absent on
    purpose: it changes live through /control, and a template change would restart the pods."""
    topo = spec.topology
    static = {
        "PDROLLOUT_ROLLOUT": name,
        "PDROLLOUT_NNODES": str(topo.nodes),
        "PDROLLOUT_GPUS_PER_NODE": str(topo.gpus_per_node),
        "PDROLLOUT_WORLD_SIZE": str(topo.world_size),
        "PDROLLOUT_MASTER_ADDR": master_address(name, namespace),
        "PDROLLOUT_MASTER_PORT": str(DIST_PORT),
        "PDROLLOUT_EP": str(topo.expert_parallel),
        "PDROLLOUT_ADP": str(topo.attention_data_parallel),
        "PDROLLOUT_ATP": str(topo.attention_tp),
        "PDROLLOUT_ETP": str(topo.expert_tp),
        "PDROLLOUT_PORT": str(spec.port),
        "PDROLLOUT_ROLLOUT_INFO": f"{CONFIG_DIR}/{ROLLOUT_INFO_KEY}",
        **network_env(spec),
    }
    return [
        _field("PDROLLOUT_NODE_RANK", f"metadata.labels['{POD_INDEX_LABEL}']"),
        _field("POD_NAME", "metadata.name"),
        _field("POD_IP", "status.podIP"),
        *(_var(k, v) for k, v in static.items()),
    ]


def engine_args(spec: PDRolloutSpec) -> list[str]:
    return ["serve", "--model", spec.model.path, "--host", "0.0.0.0", "--port", str(spec.port),
            "--mode", "pd", "--device", "cuda", "--engine-config", f"{CONFIG_DIR}/{ENGINE_CONFIG_KEY}"]


def engine_config(spec: PDRolloutSpec) -> dict:
    """Extra EngineConfig fields for `pdrollout serve --engine-config`, including the controls an
    engine starts with (so a restarted pod comes up with the current spec.multiplexing)."""
    cfg = {"dtype": spec.model.dtype, "control": spec.multiplexing.control().model_dump()}
    EngineConfig.model_validate({"model": spec.model.path, **cfg})  # the engine must accept it
    return cfg


def rollout_info(name: str, namespace: str, spec: PDRolloutSpec) -> dict:
    """The group's layout, for the engine's distributed start-up and for humans."""
    t = spec.topology
    return {"rollout": name, "nodes": t.nodes, "gpusPerNode": t.gpus_per_node, "worldSize": t.world_size,
            "expertParallel": t.expert_parallel, "attentionDataParallel": t.attention_data_parallel,
            "attentionTP": t.attention_tp, "expertTP": t.expert_tp,
            "masterAddr": master_address(name, namespace), "masterPort": DIST_PORT}


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


def _resources(spec: PDRolloutSpec) -> dict:
    r = spec.resources
    amounts = {"cpu": r.cpu, "memory": r.memory, "nvidia.com/gpu": str(spec.topology.gpus_per_node)}
    if r.rdma_per_node:
        amounts[r.rdma_resource] = str(r.rdma_per_node)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def pod_template(name: str, namespace: str, spec: PDRolloutSpec) -> dict:
    return {
        "metadata": {"labels": labels(name)},
        "spec": {
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
                # NVSHMEM/IB pin memory; the verbs device needs a locked-memory limit.
                "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
                "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                                 {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}],
            }],
            "volumes": [
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shared_memory}},
                {"name": "config", "configMap": {"name": configmap_name(name)}},
            ],
            # Exclusive placement: never two PDRollout pods (of any rollout) on one node.
            "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
                "labelSelector": {"matchExpressions": [{"key": LABEL_ROLLOUT, "operator": "Exists"}]},
                "topologyKey": "kubernetes.io/hostname",
            }]}},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "terminationGracePeriodSeconds": 30,
        },
    }


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
            "selector": {"matchLabels": {LABEL_ROLLOUT: name}},
            "template": pod_template(name, namespace, spec),
        },
    }


def desired_objects(name: str, namespace: str, spec: PDRolloutSpec) -> list[dict]:
    """In apply order: the config and the Service exist before any pod needs them."""
    return [configmap(name, namespace, spec), service(name, namespace, spec),
            statefulset(name, namespace, spec)]
