#!/usr/bin/env bash
# Stop a control plane started by start.sh DIR: each recorded process by its pid, newest first.
set -uo pipefail
dir="${1:?usage: stop.sh DIR}"
[ -d "$dir/pids" ] || exit 0
for name in kwok kube-scheduler kube-controller-manager kube-apiserver etcd; do
  f="$dir/pids/$name.pid"
  [ -f "$f" ] || continue
  pid="$(cat "$f")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
  fi
  rm -f "$f"
done
echo "[cluster] stopped ($dir)"
