#!/usr/bin/env bash
# Restart one component of a control plane started by start.sh (tests use it for the API server):
#   bash e2e/cluster/restart.sh DIR kube-apiserver [DOWN_SECONDS]
set -euo pipefail
dir="${1:?usage: restart.sh DIR NAME [DOWN_SECONDS]}"; name="${2:?component name}"; down="${3:-0}"
pid="$(cat "$dir/pids/$name.pid")"
kill -TERM "$pid" 2>/dev/null || true
for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
kill -KILL "$pid" 2>/dev/null || true
sleep "$down"
nohup bash -c "exec $(cat "$dir/cmd/$name")" >>"$dir/logs/$name.log" 2>&1 &
echo $! >"$dir/pids/$name.pid"
echo "[cluster] restarted $name (pid $!)"
