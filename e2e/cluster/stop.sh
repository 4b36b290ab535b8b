#!/usr/bin/env bash
# Stop a cluster started by start.sh DIR: each recorded process by its pid, newest first. A real-node
# cluster (start.sh DIR --real-nodes N) first lets its kubelets tear their pods down, then removes
# whatever is left: processes in its network namespaces, mounts under DIR, the namespaces themselves
# (and with them every veth and bridge), libcni's cache entries and the kubelets' log links.
# Best effort throughout (no -e): a half-started cluster must still be cleaned.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir="${1:?usage: stop.sh DIR}"
[ -d "$dir/pids" ] || exit 0
dir="$(cd "$dir" && pwd)"

stop_pid() {  # stop_pid NAME...: TERM to all at once, up to 10 s for all, then KILL
  local name pids=() p
  for name in "$@"; do
    [ -f "$dir/pids/$name.pid" ] || continue
    p="$(cat "$dir/pids/$name.pid")"
    kill -TERM "$p" 2>/dev/null && pids+=("$p")
    rm -f "$dir/pids/$name.pid"
  done
  for _ in $(seq 50); do
    local left=()
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && left+=("$p"); done
    pids=("${left[@]}")
    [ ${#pids[@]} -eq 0 ] && return 0
    sleep 0.2
  done
  kill -KILL "${pids[@]}" 2>/dev/null
}
names() { local f; for f in "$dir"/pids/$1.pid; do [ -f "$f" ] && basename "$f" .pid; done; }

alive() { [ -f "$dir/pids/$1.pid" ] && kill -0 "$(cat "$dir/pids/$1.pid")" 2>/dev/null; }

if grep -qs '^CLUSTER_MODE=real$' "$dir/cluster.env"; then
  source "$here/versions.sh"
  export PATH="$CLUSTER_PATH:$PATH"
  source "$dir/cluster.env"
  in_cp() { nsenter --net="/run/netns/$NETNS_CP" "$@"; }
  # No controller may replace what goes now.
  stop_pid kube-controller-manager kube-scheduler
  if alive kube-apiserver && alive kubelet-0; then
    in_cp kubectl --kubeconfig "$dir/kubeconfig" delete pods --all -A --grace-period=2 --wait=false \
      >/dev/null 2>&1
    for _ in $(seq 90); do
      [ -z "$(in_cp kubectl --kubeconfig "$dir/kubeconfig" get pods -A -o name 2>/dev/null)" ] && break
      sleep 0.5
    done
  fi
  # shellcheck disable=SC2046
  stop_pid $(names 'kube-proxy-*') $(names 'kubelet-*') coredns
  for sock in "$dir"/nodes/node-*/containerd.sock; do  # anything the kubelet left running
    [ -S "$sock" ] || continue
    for t in $(ctr --address "$sock" -n k8s.io tasks ls -q 2>/dev/null); do
      ctr --address "$sock" -n k8s.io tasks kill -s SIGKILL "$t" >/dev/null 2>&1
      ctr --address "$sock" -n k8s.io tasks delete -f "$t" >/dev/null 2>&1
    done
    # The node's image store outlives the cluster (real-nodes.sh): leave no containers in it.
    for ct in $(ctr --address "$sock" -n k8s.io containers ls -q 2>/dev/null); do
      ctr --address "$sock" -n k8s.io containers delete "$ct" >/dev/null 2>&1
    done
  done
  # shellcheck disable=SC2046
  stop_pid $(names 'containerd-*') kube-apiserver
  stop_pid etcd

  # Every process still in one of this cluster's network namespaces (its nodes', its control plane's,
  # its pods') is this cluster's: a container or shim that outlived its containerd.
  mapfile -t pod_ns < <(awk -v d="$dir/" '{for (i = 7; i < NF; i++) if ($i == "-") break}
                                          $(i + 1) == "nsfs" && index($5, d) == 1 {print $5}' /proc/self/mountinfo)
  inodes=" "
  for f in "/run/netns/$NETNS_CP" $(for n in $NETNS_NODES; do echo "/run/netns/$n"; done) "${pod_ns[@]}"; do
    [ -e "$f" ] && inodes+="$(stat -L -c %i "$f") "
  done
  if [ "$inodes" != " " ]; then
    for p in /proc/[0-9]*; do
      ino="$(readlink "$p/ns/net" 2>/dev/null | tr -dc 0-9)"
      [ -n "$ino" ] && [[ "$inodes" == *" $ino "* ]] && kill -KILL "${p#/proc/}" 2>/dev/null
    done
    sleep 0.5
  fi
  # Mounts under DIR (pod volumes, container root filesystems, shm, pod netns), deepest first.
  awk -v d="$dir/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r | while read -r m; do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null
  done
  for n in $NETNS_NODES $NETNS_CP; do [ -e "/run/netns/$n" ] && ip netns del "$n"; done
  # libcni's cache: our pod network's entries by name, the loopback plugin's by the sandbox's id.
  rm -f /var/lib/cni/results/"pdr-$CLUSTER_ID"-* 2>/dev/null
  # ... and the sockets of shims that were killed rather than stopped, named as containerd names them:
  # sha256 of "<containerd socket>/<namespace>/<id>".
  for b in "$dir"/nodes/node-*/containerd/state/io.containerd.runtime.v2.task/k8s.io/*/; do
    [ -d "$b" ] || continue
    id="$(basename "$b")"
    rm -f /var/lib/cni/results/cni-loopback-"$id"-* 2>/dev/null
    sock="${b%%/containerd/state/*}/containerd.sock"
    rm -f "/run/containerd/s/$(printf '%s' "$sock/k8s.io/$id" | sha256sum | cut -d' ' -f1)"
  done
  # Shared with other clusters on this machine: removed only once empty (rmdir refuses otherwise).
  rmdir /sys/fs/cgroup/*/k8s.io /run/containerd/s /run/containerd 2>/dev/null
  for l in /var/log/containers/*.log; do
    [ -L "$l" ] && [[ "$(readlink "$l")" == "$dir"/* ]] && rm -f "$l"
  done
fi

for name in fakenodes kube-scheduler kube-controller-manager kube-apiserver etcd; do stop_pid "$name"; done
echo "[cluster] stopped ($dir)"
