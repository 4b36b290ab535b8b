#!/usr/bin/env bash
# Run a command inside a real-node cluster's network (its addresses exist nowhere else), with its
# kubeconfig and the cluster's tools on PATH:
#   bash e2e/cluster/in.sh DIR kubectl get pods -A -o wide          # from the control plane's namespace
#   bash e2e/cluster/in.sh DIR --node 1 curl -s http://10.96.0.10/  # from node-1's (Service IPs work there)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir="${1:?usage: in.sh DIR [--node I] CMD...}"; shift
[ -f "$dir/cluster.env" ] && grep -qs '^CLUSTER_MODE=real$' "$dir/cluster.env" \
  || { echo "[cluster] $dir is not a real-node cluster (start.sh DIR --real-nodes N)" >&2; exit 1; }
dir="$(cd "$dir" && pwd)"
source "$here/versions.sh"
source "$dir/cluster.env"
ns="$NETNS_CP"
if [ "${1:-}" = --node ]; then
  read -r -a nss <<<"$NETNS_NODES"
  [[ "${2:-}" =~ ^[0-9]+$ ]] && [ "$2" -lt "${#nss[@]}" ] \
    || { echo "[cluster] --node takes 0..$((${#nss[@]} - 1)), got '${2:-}'" >&2; exit 1; }
  ns="${nss[$2]}"; shift 2
fi
[ $# -gt 0 ] || { echo "[cluster] no command given" >&2; exit 1; }
[ -e "/run/netns/$ns" ] || { echo "[cluster] network namespace $ns is gone: is the cluster up?" >&2; exit 1; }
exec nsenter --net="/run/netns/$ns" env KUBECONFIG="$dir/kubeconfig" PATH="$CLUSTER_PATH:$PATH" "$@"
