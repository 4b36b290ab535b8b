#!/usr/bin/env bash
# One command from a bare machine to a running real-node cluster: builds (each step cached by version),
# Debian packages, images, then start.sh DIR --real-nodes N.
#   bash e2e/cluster/up.sh DIR [NODES]          # then: bash e2e/cluster/in.sh DIR kubectl get nodes
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir="${1:?usage: up.sh DIR [NODES]}"
nodes="${2:-2}"
t0=$SECONDS
bash "$here/node-deps.sh"
nice -n 10 bash "$here/build.sh"
nice -n 10 bash "$here/images.sh" >/dev/null
bash "$here/start.sh" "$dir" --real-nodes "$nodes"
echo "[cluster] up in $((SECONDS - t0)) s"
