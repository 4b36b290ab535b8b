#!/usr/bin/env bash
# Build a gang scheduler for the tests: kube-scheduler (this cluster's Kubernetes version) with the
# Coscheduling plugin of kubernetes-sigs/scheduler-plugins, from the Go module proxy only, once per
# version. Prints the directory holding bin/kube-scheduler and podgroups.yaml (the PodGroup CRD, from
# the same module).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/versions.sh"
SCHEDULER_PLUGINS_VERSION=v0.34.7     # the release line of K8S_VERSION's minor
export GOTOOLCHAIN=local GOFLAGS="-p=2 -buildvcs=false -mod=mod" CGO_ENABLED=0
out="$PDROLLOUT_CACHE/gang-scheduler-$SCHEDULER_PLUGINS_VERSION-k8s-$K8S_VERSION"
if [ -x "$out/bin/kube-scheduler" ] && [ -f "$out/podgroups.yaml" ]; then echo "$out"; exit 0; fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
src="$(go mod download -json "sigs.k8s.io/scheduler-plugins@$SCHEDULER_PLUGINS_VERSION" | python3 -c \
  'import json,sys; print(json.load(sys.stdin)["Dir"])')"
k8s="$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c \
  'import json,sys; print(json.load(sys.stdin)["Dir"])')"
# The plugin's module, its require list kept, every Kubernetes module pinned to this cluster's version
# (k8s.io/kubernetes points its staging modules at ./staging; a module elsewhere needs versions).
cp -r "$src/." "$work/" && chmod -R u+w "$work"
rm -rf "$work/cmd" && mkdir -p "$work/cmd/gang" && cp "$here/gang/main.go" "$work/cmd/gang/"
staging_version="v0.${K8S_VERSION#v1.}"
python3 - "$work/go.mod" "$k8s/go.mod" "$K8S_VERSION" "$staging_version" <<'PY'
import re, sys
gomod, k8s_gomod, k8s_version, staging = sys.argv[1:]
text = re.sub(r"(?ms)^replace \($.*?^\)$\n?|^replace .*$\n?", "", open(gomod).read())
staged = re.findall(r"^\s*(k8s\.io/[\w.-]+) => \./staging/", open(k8s_gomod).read(), re.M)
lines = [f"\t{m} => {m} {staging}" for m in staged] + [f"\tk8s.io/kubernetes => k8s.io/kubernetes {k8s_version}"]
open(gomod, "w").write(text + "\nreplace (\n" + "\n".join(lines) + "\n)\n")
PY
(cd "$work" && go build -ldflags "-s -w" -o "$out/bin/kube-scheduler" ./cmd/gang)
cp "$work/config/crd/bases/scheduling.x-k8s.io_podgroups.yaml" "$out/podgroups.yaml"
echo "$out"
