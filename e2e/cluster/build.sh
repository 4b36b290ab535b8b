#!/usr/bin/env bash
# Build the local Kubernetes control plane from Go sources (module proxy only), once per version.
# Idempotent: a component whose cache directory holds a `.ok` stamp is reused as it is.
# Outputs: ${PDROLLOUT_CACHE:-~/.cache/pdrollout}/{k8s,etcd,kwok,helm}-<version>/bin.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/versions.sh"

export GOTOOLCHAIN=local          # never download a toolchain
export GOFLAGS="-p=2 -buildvcs=false"
export CGO_ENABLED=0              # static binaries; no C toolchain needed
ldflags="-s -w"
command -v go >/dev/null || { echo "[cluster] Go is required to build the control plane" >&2; exit 1; }

log() { echo "[cluster] $(date +%H:%M:%S) $*"; }

# build_once NAME BINDIR RECIPE CMD...: run CMD unless BINDIR/.ok holds the same RECIPE (what went into
# the build: versions, flags, wrapper go.sum), timing it.
build_once() {
  local name="$1" dir="$2" recipe="$3"; shift 3
  if [ "$(cat "$dir/.ok" 2>/dev/null)" = "$recipe" ]; then log "$name: cached in $dir"; return; fi
  log "$name: building into $dir"
  rm -rf "$dir" && mkdir -p "$dir"
  local t0=$SECONDS
  "$@"
  printf '%s' "$recipe" >"$dir/.ok"
  log "$name: built in $((SECONDS - t0)) s"
}

build_etcd() {
  (cd "$here/etcd" && nice -n 10 go build -trimpath -ldflags="$ldflags" -o "$ETCD_BIN/etcd" .)
}

# Version stamps hack/lib/version.sh would set; helm checks a chart's kubeVersion against them.
k8s_minor="${K8S_VERSION#v1.}"; k8s_minor="${k8s_minor%%.*}"
k8s_ldflags="$ldflags"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
  k8s_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

# One `go build` for all commands so they share one compile of the common packages; kubelet and
# kube-proxy are the real-node mode's (start.sh --real-nodes), from the same source version.
build_k8s() {
  (cd "$here/k8s" && nice -n 10 go build -trimpath -ldflags="$k8s_ldflags" -o "$K8S_BIN/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubectl \
    k8s.io/kubernetes/cmd/kubelet \
    k8s.io/kubernetes/cmd/kube-proxy)
}

build_coredns() {
  grep -q "github.com/coredns/coredns $COREDNS_VERSION\$" "$here/coredns/go.mod" \
    || { echo "[cluster] e2e/cluster/coredns/go.mod does not require coredns $COREDNS_VERSION" >&2; return 1; }
  (cd "$here/coredns" && nice -n 10 go build -trimpath -ldflags="$ldflags" -o "$COREDNS_BIN/coredns" .)
}

build_tool() {  # build_tool BINDIR MODULE/PATH@VERSION
  GOBIN="$1" nice -n 10 go install -trimpath -ldflags="$ldflags" "$2"
}

# Contents only (not paths), so every checkout of the same sources shares one cached build.
sum() { cat "$@" | sha256sum | cut -c1-16; }
t_all=$SECONDS
build_once "etcd $ETCD_VERSION" "$ETCD_BIN" "$ETCD_VERSION $ldflags $(sum "$here/etcd/go.sum" "$here/etcd/main.go")" \
  build_etcd
build_once "kwok $KWOK_VERSION" "$KWOK_BIN" "$KWOK_VERSION $ldflags" \
  build_tool "$KWOK_BIN" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
build_once "helm $HELM_VERSION" "$HELM_BIN" "$HELM_VERSION $ldflags" \
  build_tool "$HELM_BIN" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
build_once "kubernetes $K8S_VERSION" "$K8S_BIN" "$K8S_VERSION $k8s_ldflags $(sum "$here/k8s/go.sum" "$here/k8s/tools.go")" \
  build_k8s
build_once "coredns $COREDNS_VERSION" "$COREDNS_BIN" \
  "$COREDNS_VERSION $ldflags $(sum "$here/coredns/go.sum" "$here/coredns/main.go")" build_coredns
log "control plane ready in $((SECONDS - t_all)) s: $CLUSTER_PATH"
