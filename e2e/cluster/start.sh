#!/usr/bin/env bash
# Start a throwaway Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler and fakenodes (fake GPU nodes: tools/cmd/fakenodes), with freshly generated certificates.
#
#   bash e2e/cluster/start.sh DIR [GPU_NODES]     # default 4 GPU nodes + 1 CPU node
#   export KUBECONFIG=DIR/kubeconfig
#   bash e2e/cluster/stop.sh DIR
#
# Everything listens on 127.0.0.1; pod IPs come from 127.1.<node>.0/24 and node IPs are 127.0.1.<n>,
# so whatever follows a pod or node address stays on loopback. Ports are picked free at start.
#
#   bash e2e/cluster/start.sh DIR --real-nodes N  # real kubelets instead of fake nodes: see real-nodes.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ "${2:-}" = --real-nodes ]; then exec bash "$here/real-nodes.sh" "$1" "${3:-2}"; fi
source "$here/versions.sh"
dir="${1:?usage: start.sh DIR [GPU_NODES | --real-nodes N]}"
gpu_nodes="${2:-4}"
[[ "$gpu_nodes" =~ ^[0-9]+$ ]] || { echo "[cluster] GPU_NODES must be a number, got '$gpu_nodes'" >&2; exit 1; }
mkdir -p "$dir"/{certs,logs,pids}
dir="$(cd "$dir" && pwd)"
export PATH="$CLUSTER_PATH:$PATH"
for b in etcd kube-apiserver kube-controller-manager kube-scheduler fakenodes kubectl; do
  [ -x "$(command -v "$b")" ] && [[ "$(command -v "$b")" == "$PDROLLOUT_CACHE"/* ]] \
    || { echo "[cluster] $b is not built; run: bash e2e/cluster/build.sh" >&2; exit 1; }
done

source "$here/lib.sh"

# Free loopback ports (the OS picks them; closed again before the servers bind).
read -r etcd_port peer_port api_port kcm_port sched_port < <(python3 - <<'PY'
import socket
socks = [socket.socket() for _ in range(5)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
PY
)

# --- certificates: one CA; apiserver serving cert; admin client cert; service-account key pair ----
new_ca
sign apiserver "/CN=kube-apiserver" "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
extendedKeyUsage=serverAuth"
sign admin "/O=system:masters/CN=pdrollout-admin" "extendedKeyUsage=clientAuth"
kubeconfig "$dir/kubeconfig" "https://127.0.0.1:$api_port" admin
kc="$dir/kubeconfig"

log "etcd on 127.0.0.1:$etcd_port"
start etcd etcd --name default --data-dir "$dir/etcd" \
  --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
  --listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
  --initial-cluster "default=http://127.0.0.1:$peer_port" --unsafe-no-fsync
wait_for 60 etcd curl -sf "http://127.0.0.1:$etcd_port/health"

log "kube-apiserver $K8S_VERSION on https://127.0.0.1:$api_port"
# Service ClusterIPs come from loopback too; the operator never connects to a Service IP.
start kube-apiserver kube-apiserver \
  --etcd-servers "http://127.0.0.1:$etcd_port" \
  --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$api_port" \
  --tls-cert-file "$c/apiserver.crt" --tls-private-key-file "$c/apiserver.key" --client-ca-file "$c/ca.crt" \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --service-account-key-file "$c/sa.pub" --service-account-signing-key-file "$c/sa.key" \
  --service-cluster-ip-range 127.2.0.0/16 \
  --authorization-mode RBAC --allow-privileged=true --cert-dir "$c" --profiling=false
wait_for 120 kube-apiserver kubectl --kubeconfig "$kc" get --raw /readyz

common=(--kubeconfig "$kc" --authentication-kubeconfig "$kc" --authorization-kubeconfig "$kc"
        --bind-address 127.0.0.1 --leader-elect=false --profiling=false)
log "kube-controller-manager and kube-scheduler"
# Fake nodes never fail: a long node grace period keeps a briefly late heartbeat (a busy CI machine)
# from turning every node NotReady, which would mark every pod unready for good (fakenodes sets pod
# readiness once, at start).
start kube-controller-manager kube-controller-manager "${common[@]}" --secure-port "$kcm_port" \
  --service-account-private-key-file "$c/sa.key" --root-ca-file "$c/ca.crt" \
  --use-service-account-credentials=false --controllers '*' --node-monitor-grace-period 10m
start kube-scheduler kube-scheduler "${common[@]}" --secure-port "$sched_port"

log "fakenodes (pod IPs from each node's 127.1.<n>.0/24)"
start fakenodes fakenodes --kubeconfig "$kc" --node-annotation pdrollout.io/fake-node=true

node() {  # node NAME INDEX GPUS
  cat <<EOF
---
apiVersion: v1
kind: Node
metadata:
  name: $1
  annotations: {pdrollout.io/fake-node: "true", node.alpha.kubernetes.io/ttl: "0"}
  labels:
    kubernetes.io/hostname: $1
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    pdrollout.io/gpu-node: "$([ "$3" -gt 0 ] && echo true || echo false)"
spec:
  podCIDR: 127.1.$2.0/24
  podCIDRs: [127.1.$2.0/24]
status:
  addresses: [{type: InternalIP, address: 127.0.1.$(($2 + 1))}, {type: Hostname, address: $1}]
  allocatable: &res {cpu: "128", memory: 2Ti, pods: "110", nvidia.com/gpu: "$3", rdma/ib: "$3"}
  capacity: *res
  nodeInfo: {architecture: amd64, operatingSystem: linux, kubeletVersion: fake, kubeProxyVersion: fake,
             bootID: "", containerRuntimeVersion: "", kernelVersion: "", machineID: "", osImage: "",
             systemUUID: ""}
EOF
}
{
  for ((i = 0; i < gpu_nodes; i++)); do node "gpu-$i" "$i" 8; done
  node cpu-0 100 0
} >"$dir/nodes.yaml"
kubectl --kubeconfig "$kc" apply -f "$dir/nodes.yaml" >/dev/null
wait_for 60 "fakenodes to mark nodes Ready" \
  kubectl --kubeconfig "$kc" wait --for=condition=Ready node --all --timeout=1s
# The controller-manager is working once it has made the default ServiceAccount.
wait_for 120 "the default ServiceAccount" kubectl --kubeconfig "$kc" get serviceaccount default -n default

log "ready: export KUBECONFIG=$kc"
