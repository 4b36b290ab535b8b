#!/usr/bin/env bash
# Install what the real-node mode runs besides our own builds: Debian's containerd, runc, CNI plugins,
# iptables (kube-proxy's rules), debootstrap (the images' root filesystem) and a C compiler (the pause
# binary). Idempotent: apt-get runs only when one of the packages is missing.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/versions.sh"

missing=()
for p in $NODE_PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
[ "$(id -u)" = 0 ] || { echo "[cluster] the real-node mode needs root (containerd, network namespaces)" >&2; exit 1; }
command -v apt-get >/dev/null || { echo "[cluster] the real-node mode installs Debian packages: apt-get is required" >&2; exit 1; }
echo "[cluster] installing Debian packages: ${missing[*]}"
apt-get update -qq
# --no-install-recommends: containerd must not bring a second runtime or a host-wide service.
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
