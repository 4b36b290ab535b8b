# Pinned versions of the local control plane; sourced by build.sh and start.sh (one place).
# Kubernetes 1.34 wants etcd >= 3.5.13; 3.6 is its tested line. kwok v0.7.0 and helm v3.19.5 are
# the newest releases whose go.mod accepts Go 1.24+, so a go1.24..1.26 toolchain builds all of it.
K8S_VERSION=v1.34.4
ETCD_VERSION=v3.6.16
KWOK_VERSION=v0.7.0
HELM_VERSION=v3.19.5
# Cluster DNS of the real-node mode; its version is the one in e2e/cluster/coredns/go.mod.
COREDNS_VERSION=v1.13.2
PDROLLOUT_CACHE="${PDROLLOUT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdrollout}"
K8S_BIN="$PDROLLOUT_CACHE/k8s-$K8S_VERSION/bin"
ETCD_BIN="$PDROLLOUT_CACHE/etcd-$ETCD_VERSION/bin"
KWOK_BIN="$PDROLLOUT_CACHE/kwok-$KWOK_VERSION/bin"
HELM_BIN="$PDROLLOUT_CACHE/helm-$HELM_VERSION/bin"
COREDNS_BIN="$PDROLLOUT_CACHE/coredns-$COREDNS_VERSION/bin"
CLUSTER_PATH="$K8S_BIN:$ETCD_BIN:$KWOK_BIN:$HELM_BIN:$COREDNS_BIN"

# Real-node mode (start.sh DIR --real-nodes N): the node runtime comes from Debian's packages (installed
# by node-deps.sh); kubelet and kube-proxy are built into K8S_BIN above, from the same source version.
NODE_PACKAGES="containerd runc containernetworking-plugins iptables conntrack debootstrap gcc libc6-dev"
CNI_BIN=/usr/lib/cni
# Images (images.sh): a Debian root filesystem of this suite, and the Python wheels pinned here.
IMAGE_SUITE=bookworm
IMAGE_TORCH="torch==2.11.0"
IMAGES_DIR="$PDROLLOUT_CACHE/images"
