# Pinned versions of the local control plane; sourced by build.sh and start.sh (one place).
# Kubernetes 1.34 wants etcd >= 3.5.13; 3.6 is its tested line. All are built by one
# `go build` of the module in tools/ (its go.mod must require these versions; build.sh checks), so
# their shared packages compile once; etcd 3.6.16 needs a go1.26 toolchain.
K8S_VERSION=v1.34.4
ETCD_VERSION=v3.6.16
HELM_VERSION=v3.19.5
# Cluster DNS of the real-node mode.
COREDNS_VERSION=v1.13.2
# The gang scheduler of the tests: kube-scheduler with the Coscheduling plugin of this release line.
SCHEDULER_PLUGINS_VERSION=v0.34.7
PDROLLOUT_CACHE="${PDROLLOUT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdrollout}"
TOOLS_DIR="$PDROLLOUT_CACHE/cluster-tools-$K8S_VERSION"
K8S_BIN="$TOOLS_DIR/bin"
ETCD_BIN="$TOOLS_DIR/bin"
HELM_BIN="$TOOLS_DIR/bin"
COREDNS_BIN="$TOOLS_DIR/bin"
GANG_SCHEDULER="$TOOLS_DIR/bin/gang"
PODGROUP_CRD="$TOOLS_DIR/podgroups.yaml"
CLUSTER_PATH="$TOOLS_DIR/bin"

# Real-node mode (start.sh DIR --real-nodes N): the node runtime comes from Debian's packages (installed
# by node-deps.sh); kubelet and kube-proxy are built into K8S_BIN above, from the same source version.
NODE_PACKAGES="containerd runc containernetworking-plugins iptables conntrack debootstrap gcc libc6-dev"
CNI_BIN=/usr/lib/cni
# Images (images.sh): a Debian root filesystem of this suite, and the Python wheels pinned here.
IMAGE_SUITE=bookworm
IMAGES_DIR="$PDROLLOUT_CACHE/images"
