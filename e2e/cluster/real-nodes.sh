#!/usr/bin/env bash
# A throwaway Kubernetes cluster with real nodes, all on this machine and inside network namespaces
# that this script makes: the control plane of start.sh, plus per node a containerd (Debian's, with
# runc), a kubelet and a kube-proxy built from the control plane's Kubernetes source version.
#
#   bash e2e/cluster/start.sh DIR --real-nodes 2        # (or: bash e2e/cluster/real-nodes.sh DIR 2)
#   bash e2e/cluster/in.sh DIR kubectl get nodes -o wide  # any command, inside the cluster's network
#   bash e2e/cluster/stop.sh DIR                        # processes, mounts, namespaces: all gone
#
# Prerequisites (each cached / idempotent): build.sh, node-deps.sh, images.sh; up.sh runs all of them.
#
# Network: no address of it exists outside its namespaces, and none of them has a route off the machine.
#   pdr-<id>-cp   control plane (etcd on its loopback; API server on 10.250.0.1:6443), bridge pdr0
#   pdr-<id>-n<i> node-<i>: eth0 10.250.0.(10+i) (veth to pdr0), pods 10.244.<i>.0/24 on a CNI bridge
# Services get 10.96.0.0/16 (kube-proxy's iptables rules live in each node's namespace); cluster DNS
# is CoreDNS beside the control plane at 10.250.0.1:53.
# Runtime settings this VM needs (hybrid cgroups v1/v2, no lower oom scores): cgroupfs driver, no QoS
# cgroups, restrict_oom_score_adj; one containerd per kubelet (a kubelet collects sandboxes it does
# not know). Images come only from images.sh (imported; nothing is ever pulled).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/versions.sh"
dir="${1:?usage: real-nodes.sh DIR [NODES]}"
nodes="${2:-2}"
fail() { echo "[cluster] $*" >&2; exit 1; }
[[ "$nodes" =~ ^[1-9]$ ]] || fail "NODES must be 1..9, got '$nodes'"
[ "$(id -u)" = 0 ] || fail "the real-node mode needs root (network namespaces, containerd, mounts)"
mkdir -p "$dir"/{certs,logs,pids}
dir="$(cd "$dir" && pwd)"
export PATH="$CLUSTER_PATH:$PATH"

# --- prerequisites: say which script makes what is missing ------------------------------------------
for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy coredns; do
  [ -x "$(command -v "$b")" ] && [[ "$(command -v "$b")" == "$PDROLLOUT_CACHE"/* ]] \
    || fail "$b is not built; run: bash e2e/cluster/build.sh"
done
for b in containerd ctr runc iptables ip nsenter; do
  command -v "$b" >/dev/null || fail "$b is missing; run: bash e2e/cluster/node-deps.sh"
done
for p in bridge host-local loopback; do
  [ -x "$CNI_BIN/$p" ] || fail "CNI plugin $CNI_BIN/$p is missing; run: bash e2e/cluster/node-deps.sh"
done
[ -f "$IMAGES_DIR/refs.env" ] || fail "no images; run: bash e2e/cluster/images.sh"
source "$IMAGES_DIR/refs.env"
for r in "$PAUSE_RECIPE" "$OPERATOR_RECIPE" "$ENGINE_RECIPE" "$ROUTER_RECIPE"; do
  [ -f "$r" ] || fail "image recipe $r is gone; run: bash e2e/cluster/images.sh"
done
[ -d /sys/fs/cgroup ] || fail "no /sys/fs/cgroup: a kubelet needs cgroups"

source "$here/lib.sh"
bin() { command -v "$1"; }

# --- names and addresses ------------------------------------------------------------------------------
id="$(printf %s "$dir" | sha256sum | cut -c1-8)"   # one cluster per DIR; several DIRs side by side
ns_cp="pdr-$id-cp"
cp_ip=10.250.0.1
node_ip() { echo "10.250.0.$((10 + $1))"; }
node_ns() { echo "pdr-$id-n$1"; }
in_ns() { local ns="$1"; shift; nsenter --net="/run/netns/$ns" "$@"; }
for ((i = -1; i < nodes; i++)); do
  ns="$([ "$i" -lt 0 ] && echo "$ns_cp" || node_ns "$i")"
  [ ! -e "/run/netns/$ns" ] || fail "network namespace $ns exists: a cluster of $dir is up; bash e2e/cluster/stop.sh $dir"
done

# Written first, so stop.sh knows what to clean even after a failed start.
node_names=() node_ips=() node_nss=()
for ((i = 0; i < nodes; i++)); do node_names+=("node-$i"); node_ips+=("$(node_ip $i)"); node_nss+=("$(node_ns $i)"); done
cat >"$dir/cluster.env" <<EOF
CLUSTER_MODE=real
CLUSTER_ID=$id
NETNS_CP=$ns_cp
NETNS_NODES="${node_nss[*]}"
NODE_NAMES="${node_names[*]}"
NODE_IPS="${node_ips[*]}"
API_SERVER=https://$cp_ip:6443
CLUSTER_DNS=$cp_ip
POD_CIDR=10.244.0.0/16
SERVICE_CIDR=10.96.0.0/16
PAUSE_IMAGE=$PAUSE_IMAGE
OPERATOR_IMAGE=$OPERATOR_IMAGE
ENGINE_IMAGE=$ENGINE_IMAGE
ROUTER_IMAGE=$ROUTER_IMAGE
ENGINE_MODEL=$ENGINE_MODEL
EOF

# --- network ----------------------------------------------------------------------------------------
log "network namespaces $ns_cp ${node_nss[*]}"
ip netns add "$ns_cp"
ip -n "$ns_cp" link set lo up
ip -n "$ns_cp" link add pdr0 type bridge
ip -n "$ns_cp" addr add "$cp_ip/24" dev pdr0
ip -n "$ns_cp" link set pdr0 up
in_ns "$ns_cp" sysctl -qw net.ipv4.ip_forward=1
for ((i = 0; i < nodes; i++)); do
  ns="$(node_ns $i)"
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  ip -n "$ns_cp" link add "n$i" type veth peer name eth0 netns "$ns"
  ip -n "$ns_cp" link set "n$i" master pdr0 up
  ip -n "$ns" addr add "$(node_ip $i)/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" route add default via "$cp_ip"          # other nodes' pods and services, via the control plane
  ip -n "$ns_cp" route add "10.244.$i.0/24" via "$(node_ip $i)"
  in_ns "$ns" sysctl -qw net.ipv4.ip_forward=1
  # kube-proxy's rules must see bridged pod-to-pod traffic (a pod reaching its own node's pods by a Service).
  in_ns "$ns" sysctl -qw net.bridge.bridge-nf-call-iptables=1
done

# --- certificates -----------------------------------------------------------------------------------
new_ca
sign apiserver "/CN=kube-apiserver" "subjectAltName=IP:$cp_ip,IP:10.96.0.1,IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
extendedKeyUsage=serverAuth"
sign admin "/O=system:masters/CN=pdrollout-admin" "extendedKeyUsage=clientAuth"
sign kube-proxy "/CN=system:kube-proxy" "extendedKeyUsage=clientAuth"
sign coredns "/CN=pdrollout:coredns" "extendedKeyUsage=clientAuth"
kubeconfig "$dir/kubeconfig" "https://$cp_ip:6443" admin
kubeconfig "$dir/kube-proxy.kubeconfig" "https://$cp_ip:6443" kube-proxy
kubeconfig "$dir/coredns.kubeconfig" "https://$cp_ip:6443" coredns
for ((i = 0; i < nodes; i++)); do
  # The node authorizer knows a kubelet by this identity; the API server checks its serving cert.
  sign "node-$i" "/O=system:nodes/CN=system:node:node-$i" "extendedKeyUsage=clientAuth"
  sign "node-$i-serving" "/CN=node-$i" "subjectAltName=IP:$(node_ip $i),DNS:node-$i
extendedKeyUsage=serverAuth"
  kubeconfig "$dir/node-$i.kubeconfig" "https://$cp_ip:6443" "node-$i"
done
kc="$dir/kubeconfig"
kubectl_cp() { in_ns "$ns_cp" kubectl --kubeconfig "$kc" "$@"; }

# --- nodes' containerd first: importing the images overlaps the control plane's start -----------
# A node's containerd keeps its images in a root under the cache (node-<i>), reused by the next cluster:
# importing (a few GB) and deleting them again would cost minutes per start. The containerd process
# holds a lock on it for its lifetime; a second cluster running meanwhile gets a fresh root under DIR.
mkdir -p "$PDROLLOUT_CACHE/real-nodes"
roots=()
for ((i = 0; i < nodes; i++)); do
  nd="$dir/nodes/node-$i"
  mkdir -p "$nd"/{cni,ipam,pod-logs,kubelet}
  exec {lock}>"$PDROLLOUT_CACHE/real-nodes/node-$i.lock"
  if flock -n "$lock"; then
    roots+=("$PDROLLOUT_CACHE/real-nodes/node-$i")
  else
    roots+=("$nd/containerd/root")
    exec {lock}>&-
    lock=""
  fi
  cat >"$nd/containerd.toml" <<EOF
version = 2
root = "${roots[$i]}"
state = "$nd/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "$nd/containerd.sock"
[ttrpc]
  address = "$nd/containerd-ttrpc.sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "$nd/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN"
    conf_dir = "$nd/cni"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "$(bin runc)"
        Root = "$nd/runc"
        SystemdCgroup = false
EOF
  # The network name is unique per cluster: libcni keeps its result cache in /var/lib/cni by that name.
  cat >"$nd/cni/10-pdrollout.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "pdr-$id-n$i", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "dataDir": "$nd/ipam", "ranges": [[{"subnet": "10.244.$i.0/24"}]],
            "routes": [{"dst": "0.0.0.0/0"}]}}]}
EOF
  start "containerd-$i" nsenter --net="/run/netns/$(node_ns $i)" "$(bin containerd)" --config "$nd/containerd.toml"
  [ -z "$lock" ] || exec {lock}>&-  # containerd holds it now
done
for ((i = 0; i < nodes; i++)); do
  wait_for 60 "containerd on node-$i" ctr --address "$dir/nodes/node-$i/containerd.sock" version
done

log "importing images into each node's containerd (in the background)"
t0=$SECONDS
# One node after the other, each image's layer blobs removed as soon as it is unpacked: an import holds
# the blobs beside the unpacked copy (the torch layer twice, ~4 GB more), so at most one is in flight.
import_node() {  # import_node I
  local i="$1" ref img mark have  # called in an || list, where set -e is off: each step returns on failure
  local ctr=(ctr --address "$dir/nodes/node-$i/containerd.sock" -n k8s.io)
  have="$("${ctr[@]}" images ls -q)" || return
  for ref in $have; do  # earlier builds of our images: their layers go with them (containerd's GC)
    # --sync: the GC is done before the imports below start. Asynchronous, it removed a base-layer
    # snapshot that an import had just found present and was unpacking onto ("parent snapshot ...
    # does not exist").
    case " $PAUSE_IMAGE $OPERATOR_IMAGE $ENGINE_IMAGE $ROUTER_IMAGE " in
      *" $ref "*) ;;
      *) "${ctr[@]}" images rm --sync "$ref" || return; rm -f "${roots[$i]}/.imported-$(echo "$ref" | tr '/:' '__')" ;;
    esac
  done
  for img in "$PAUSE_IMAGE=$PAUSE_RECIPE" "$OPERATOR_IMAGE=$OPERATOR_RECIPE" "$ENGINE_IMAGE=$ENGINE_RECIPE" \
             "$ROUTER_IMAGE=$ROUTER_RECIPE"; do
    mark="${roots[$i]}/.imported-$(echo "${img%%=*}" | tr '/:' '__')"
    if [ -f "$mark" ] && grep -qx "${img%%=*}" <<<"$have"; then echo "${img%%=*}: present"; continue; fi
    python3 "$here/oci.py" image --recipe "${img#*=}" --out - | "${ctr[@]}" images import - || return
    # Unpacked, the layer blobs are dead weight (what containerd's discard_unpacked_layers does on a pull).
    for d in $LAYER_DIGESTS; do "${ctr[@]}" content rm "$d" 2>/dev/null || true; done
    touch "$mark"
  done
}
(for ((i = 0; i < nodes; i++)); do import_node "$i" >>"$dir/logs/import-$i.log" 2>&1 || exit $((i + 1)); done) &
importing=$!

# --- control plane, inside $ns_cp -------------------------------------------------------------------
cp=(nsenter --net="/run/netns/$ns_cp")
log "etcd and kube-apiserver $K8S_VERSION on https://$cp_ip:6443 (in $ns_cp)"
start etcd "${cp[@]}" "$(bin etcd)" --name default --data-dir "$dir/etcd" \
  --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
  --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
  --initial-cluster default=http://127.0.0.1:2380 --unsafe-no-fsync
wait_for 60 etcd "${cp[@]}" curl -sf http://127.0.0.1:2379/health
start kube-apiserver "${cp[@]}" "$(bin kube-apiserver)" \
  --etcd-servers http://127.0.0.1:2379 \
  --bind-address 0.0.0.0 --advertise-address "$cp_ip" --secure-port 6443 \
  --tls-cert-file "$c/apiserver.crt" --tls-private-key-file "$c/apiserver.key" --client-ca-file "$c/ca.crt" \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --service-account-key-file "$c/sa.pub" --service-account-signing-key-file "$c/sa.key" \
  --service-cluster-ip-range 10.96.0.0/16 \
  --authorization-mode Node,RBAC --allow-privileged=true --cert-dir "$c" --profiling=false \
  --kubelet-preferred-address-types InternalIP --kubelet-certificate-authority "$c/ca.crt" \
  --kubelet-client-certificate "$c/admin.crt" --kubelet-client-key "$c/admin.key"
wait_for 120 kube-apiserver kubectl_cp get --raw /readyz

log "kube-controller-manager, kube-scheduler"
common=(--kubeconfig "$kc" --authentication-kubeconfig "$kc" --authorization-kubeconfig "$kc"
        --bind-address 127.0.0.1 --leader-elect=false --profiling=false)
start kube-controller-manager "${cp[@]}" "$(bin kube-controller-manager)" "${common[@]}" --secure-port 10257 \
  --service-account-private-key-file "$c/sa.key" --root-ca-file "$c/ca.crt" \
  --use-service-account-credentials=false --controllers '*'
start kube-scheduler "${cp[@]}" "$(bin kube-scheduler)" "${common[@]}" --secure-port 10259

# Cluster DNS: CoreDNS reads Services and EndpointSlices with a read-only identity.
kubectl_cp apply -f - >/dev/null <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "pdrollout:coredns"}
rules:
- {apiGroups: [""], resources: [endpoints, services, pods, namespaces], verbs: [list, watch]}
- {apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "pdrollout:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "pdrollout:coredns"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "pdrollout:coredns"}]
EOF
cat >"$dir/Corefile" <<EOF
.:53 {
    bind $cp_ip
    errors
    health 127.0.0.1:8081
    ready 127.0.0.1:8182
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $dir/coredns.kubeconfig pdrollout
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 5
    loadbalance
}
EOF
log "CoreDNS on $cp_ip:53"
start coredns "${cp[@]}" "$(bin coredns)" -conf "$dir/Corefile"

wait "$importing" || { i=$(($? - 1)); die "image import into node-$i failed: $(tail -n 1 "$dir/logs/import-$i.log")"; }
log "images imported in $((SECONDS - t0)) s"

# --- nodes: kubelet and kube-proxy, each inside its node's namespace ---------------------------------
for ((i = 0; i < nodes; i++)); do
  nd="$dir/nodes/node-$i"
  cat >"$nd/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $(node_ip $i)
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
tlsCertFile: $c/node-$i-serving.crt
tlsPrivateKeyFile: $c/node-$i-serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $c/ca.crt}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix://$nd/containerd.sock
# This VM: hybrid cgroups v1/v2 and two kubelets on one machine.
cgroupDriver: cgroupfs
failCgroupV1: false
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
clusterDomain: cluster.local
clusterDNS: [$cp_ip]
resolvConf: ""
podLogsDir: $nd/pod-logs
# Images cannot be pulled again, so the kubelet must never collect them.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: 2%, imagefs.available: 2%}
rotateCertificates: false
EOF
  start "kubelet-$i" nsenter --net="/run/netns/$(node_ns $i)" "$(bin kubelet)" --config "$nd/kubelet.yaml" \
    --kubeconfig "$dir/node-$i.kubeconfig" --root-dir "$nd/kubelet" \
    --hostname-override "node-$i" --node-ip "$(node_ip $i)"
  # Every kubelet binds one fixed device-plugin socket (/var/lib/kubelet/device-plugins/kubelet.sock,
  # not under --root-dir); two starting together race for it and the loser never registers. One at a
  # time: the next starts once this one registered (it binds the socket before registering).
  wait_for 120 "node-$i to register" kubectl_cp get node "node-$i"
  cat >"$nd/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $dir/kube-proxy.kubeconfig}
hostnameOverride: node-$i
mode: iptables
clusterCIDR: 10.244.0.0/16
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
nodePortAddresses: [primary]
# Leave the machine-wide conntrack sysctls alone (not this namespace's to change).
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
  start "kube-proxy-$i" nsenter --net="/run/netns/$(node_ns $i)" "$(bin kube-proxy)" --config "$nd/kube-proxy.yaml"
done

node_count() { [ "$(kubectl_cp get nodes -o name | wc -l)" -eq "$nodes" ]; }
wait_for 120 "$nodes nodes to register" node_count
wait_for 180 "nodes to turn Ready" kubectl_cp wait --for=condition=Ready node --all --timeout=2s
wait_for 120 "the default ServiceAccount" kubectl_cp get serviceaccount default -n default
for ((i = 0; i < nodes; i++)); do
  wait_for 60 "kube-proxy on node-$i" in_ns "$(node_ns $i)" curl -sf http://127.0.0.1:10256/healthz
done
wait_for 60 "CoreDNS" in_ns "$ns_cp" curl -sf http://127.0.0.1:8182/ready
log "ready ($nodes real nodes): bash e2e/cluster/in.sh $dir kubectl get nodes -o wide"
