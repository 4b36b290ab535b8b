#!/usr/bin/env bash
# Build the local Kubernetes control plane from Go sources (module proxy only), once per version.
# Idempotent: a component whose cache directory holds a `.ok` stamp is reused as it is.
# Output: ${PDROLLOUT_CACHE:-~/.cache/pdrollout}/cluster-tools-<k8s version>/bin.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/versions.sh"

export GOTOOLCHAIN=local          # never download a toolchain
export GOFLAGS="-p=2 -buildvcs=false"
export CGO_ENABLED=0              # static binaries; no C toolchain needed
ldflags="-s -w"
# -s -w drops the debug info at link, so the compiler need not make it either (-dwarf=false: ~9 %
# less CPU for the build, README).
gcflags="all=-dwarf=false"
command -v go >/dev/null || { echo "[cluster] Go is required to build the control plane" >&2; exit 1; }

log() { echo "[cluster] $(date +%H:%M:%S) $*"; }

# One builder per cache: a second caller (a test beside .ci/run's background build) waits, then
# finds everything built.
mkdir -p "$PDROLLOUT_CACHE"
exec 9>"$PDROLLOUT_CACHE/build.lock"
flock 9

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

# Version stamps hack/lib/version.sh would set; helm checks a chart's kubeVersion against them.
k8s_minor="${K8S_VERSION#v1.}"; k8s_minor="${k8s_minor%%.*}"
k8s_ldflags="$ldflags"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
  k8s_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

# tools/go.mod must build what versions.sh names (one place for the versions, checked here).
check_versions() {
  local want
  for want in "github.com/coredns/coredns $COREDNS_VERSION" "go.etcd.io/etcd/server/v3 $ETCD_VERSION" \
      "helm.sh/helm/v3 $HELM_VERSION" "sigs.k8s.io/scheduler-plugins $SCHEDULER_PLUGINS_VERSION" \
      "k8s.io/kubernetes => k8s.io/kubernetes $K8S_VERSION"; do
    grep -q "^[[:space:]]*$want\$" "$here/tools/go.mod" \
      || { echo "[cluster] e2e/cluster/tools/go.mod does not have '$want' (versions.sh)" >&2; return 1; }
  done
}

# One `go build` for every command, so they share one compile of the common packages; kubelet and
# kube-proxy are the real-node mode's (start.sh --real-nodes); gang is the tests' gang scheduler,
# with the PodGroup CRD of the same module beside it.
build_tools() {
  check_versions
  (cd "$here/tools" && go build -trimpath -gcflags="$gcflags" -ldflags="$k8s_ldflags" -o "$TOOLS_DIR/bin/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubectl \
    k8s.io/kubernetes/cmd/kubelet \
    k8s.io/kubernetes/cmd/kube-proxy \
    helm.sh/helm/v3/cmd/helm \
    ./cmd/etcd ./cmd/coredns ./cmd/gang ./cmd/fakenodes)
  local plugins
  plugins="$(cd "$here/tools" && go list -m -f '{{.Dir}}' sigs.k8s.io/scheduler-plugins)"
  cp "$plugins/config/crd/bases/scheduling.x-k8s.io_podgroups.yaml" "$PODGROUP_CRD"
}

# Contents only (not paths), so every checkout of the same sources shares one cached build.
sum() { cat "$@" | sha256sum | cut -c1-16; }
t_all=$SECONDS
build_once "kubernetes $K8S_VERSION, etcd $ETCD_VERSION, helm $HELM_VERSION, coredns $COREDNS_VERSION, gang scheduler, fakenodes" \
  "$TOOLS_DIR/bin" "$K8S_VERSION $gcflags $k8s_ldflags $(cd "$here/tools" && sum go.mod go.sum tools.go cmd/*/main.go)" build_tools
for old in "$PDROLLOUT_CACHE"/cluster-tools-*; do  # builds of other versions (~0.5 GB each)
  [ "$old" = "$TOOLS_DIR" ] || { log "removing $old (another version)"; rm -rf "$old"; }
done
log "control plane ready in $((SECONDS - t_all)) s: $CLUSTER_PATH"
