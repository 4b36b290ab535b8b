#!/usr/bin/env bash
# The local demo on real nodes: a 2-node cluster (up.sh), the chart's operator, a `device: cpu`
# PDRollout of 2 pods x 2 ranks forming one engine, a short replay through its client Service, and the
# figures the operator read back into the resource's status. The cluster keeps running afterwards.
#   bash e2e/cluster/demo.sh DIR            # root; then: bash e2e/cluster/stop.sh DIR
# A second run on the same DIR reuses the running cluster and replays again.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
dir="${1:?usage: demo.sh DIR}"
t0=$SECONDS
# A cluster of DIR that is already up is reused (the demo is idempotent: upgrade, apply, wait).
if bash "$here/in.sh" "$dir" kubectl get nodes >/dev/null 2>&1; then
  echo "[demo] reusing the cluster of $dir"
else
  bash "$here/up.sh" "$dir"
fi
dir="$(cd "$dir" && pwd)"
source "$root/e2e/lib/env.sh"
pdrollout_venv >/dev/null
source "$here/versions.sh"
source "$IMAGES_DIR/refs.env"
on_cluster() { bash "$here/in.sh" "$dir" "$@"; }
ns=pdrollout-demo name=tiny-cpu port=30000

echo "[demo] installing the chart (operator image $OPERATOR_IMAGE), watching namespace $ns"
# The chart's RBAC is namespaced by default: a Role in each watched namespace, which must exist first.
on_cluster kubectl create namespace "$ns" --dry-run=client -o yaml | on_cluster kubectl apply -f - >/dev/null
on_cluster helm upgrade --install pdr "$root/charts/pdrollout-operator" -n pdrollout-system --create-namespace \
  --set image.repository="${OPERATOR_IMAGE%:*}" --set image.tag="${OPERATOR_IMAGE##*:}" \
  --set image.pullPolicy=Never --set "watchNamespaces={$ns}" --wait --timeout 300s >/dev/null

# The example as it is, but with the engine image built here and requests that fit: both nodes share
# this machine's cores, and the operator makes limits = requests.
manifest="$dir/demo-rollout.yaml"
"$PDROLLOUT_VENV/bin/python" - "$root/examples/pdrollout-cpu.yaml" "$ENGINE_IMAGE" >"$manifest" <<'PY'
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
doc["spec"]["image"] = sys.argv[2]
doc["spec"]["resources"] = {"cpu": "1", "memory": "3Gi", "sharedMemory": "256Mi"}
print(yaml.safe_dump(doc))
PY
on_cluster kubectl apply -n "$ns" -f "$manifest"
echo "[demo] waiting for the group to join (both pods Ready, phase Running)"
on_cluster kubectl wait -n "$ns" "pdrollout/$name" --for=jsonpath='{.status.phase}'=Running --timeout=600s
on_cluster kubectl get pods -n "$ns" -o wide

ip="$(on_cluster kubectl get svc -n "$ns" "$name-api" -o jsonpath='{.spec.clusterIP}')"
out="$dir/demo-bench"
"$PDROLLOUT_VENV/bin/pdrollout" trace --preset tiny --seed 0 --out "$dir/demo-trace.jsonl" >/dev/null
echo "[demo] replaying the tiny trace through Service $name-api ($ip:$port), from node-0"
on_cluster --node 0 "$PDROLLOUT_VENV/bin/pdrollout" bench --url "http://$ip:$port" --trace "$dir/demo-trace.jsonl" \
  --pressure P1 --out "$out" --no-progress
# The operator polls node 0's /metrics; wait for its figures to reach the status.
on_cluster kubectl wait -n "$ns" "pdrollout/$name" --for=jsonpath='{.status.makespanSeconds}' --timeout=120s >/dev/null
on_cluster kubectl get pdrollout -n "$ns" "$name"
on_cluster kubectl get pdrollout -n "$ns" "$name" -o jsonpath='{.status}' | "$PDROLLOUT_VENV/bin/python" -c \
  'import json, sys; s = json.load(sys.stdin); print({k: s.get(k) for k in ("phase", "readyNodes", "makespanSeconds", "ttftP99Seconds", "meanDecodeWaitSeconds")})'
echo "[demo] done in $((SECONDS - t0)) s; results in $out; stop with: bash e2e/cluster/stop.sh $dir"
