"""Run what the operator's builders put in a pod, as a process tree on this machine.

Only the pod-specific values are resolved, the way the kubelet would: downward-API env (node rank
from the pod-index label, pod name, pod IP), `$(VAR)` in args, the ConfigMap written where the pod
mounts it, and the master's DNS name (the headless Service) mapped to node 0's address. Everything
else is the container's command, args and env exactly as built.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pdrollout.operator import builders

# Inherited variables that would change the group's layout: only the pod's env may say these.
_SCRUB = re.compile(r"^(PDROLLOUT_|RANK$|WORLD_SIZE$|LOCAL_RANK$|MASTER_ADDR$|MASTER_PORT$|GLOO_SOCKET_IFNAME$)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion in command/args ($$ escapes; unknown names stay as written)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def write_config(configmap: dict, into: Path, master_ip: str, master_port: int) -> Path:
    """The ConfigMap's files where the pod mounts them; the master's Service DNS name (which only
    the cluster's DNS resolves) becomes node 0's address, and the store port a free one (in a pod
    the port is the pod's own; here both "pods" share the host's ports)."""
    into.mkdir(parents=True, exist_ok=True)
    for key, text in configmap["data"].items():
        if key == builders.ROLLOUT_INFO_KEY:
            info = json.loads(text)
            info["masterAddr"], info["masterPort"] = master_ip, master_port
            text = json.dumps(info)
        (into / key).write_text(text)
    return into


def write_secret(secret: dict, into: Path) -> Path:
    """The Secret's keys as files, where the pod mounts it (the kubelet decodes `data`)."""
    import base64
    into.mkdir(parents=True, exist_ok=True)
    for key, b64 in secret["data"].items():
        (into / key).write_bytes(base64.b64decode(b64))
    return into


@dataclass
class PodProcess:
    name: str
    ip: str
    proc: subprocess.Popen
    log: Path

    @property
    def pgid(self) -> int:
        return self.proc.pid   # its own session: the whole tree is one process group

    def alive_in_group(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
            return True
        except ProcessLookupError:
            return False

    def kill_tree(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]


def report_exit(cluster, ns: str, pod: dict, code: int, gone_ok: bool = False) -> None:
    """What a kubelet reports when the engine container exits and restarts (fake nodes run no containers).
    `gone_ok`: the pod may already be deleted (the operator recreating its group on another pod's
    report), as a kubelet then has nothing to report."""
    c = pod["spec"]["containers"][0]
    r = cluster.kubectl("patch", "pod", pod["metadata"]["name"], "-n", ns, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": {"containerStatuses": [{
                        "name": c["name"], "image": c["image"], "imageID": "", "ready": False, "restartCount": 1,
                        "started": False, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        "lastState": {"terminated": {"exitCode": code, "reason": "Error",
                                                     "startedAt": "2026-11-30T10:00:00Z",
                                                     "finishedAt": "2026-11-30T10:05:00Z"}}}]}}),
                        check=False)
    if r.returncode and not (gone_ok and "NotFound" in r.stderr):
        raise AssertionError(f"reporting {pod['metadata']['name']}'s exit failed ({r.returncode}): {r.stderr}")


def launch(container: dict, *, pod_name: str, node_rank: int, pod_ip: str, config_dir: Path,
           log: Path, secret_dir: Path | None = None) -> PodProcess:
    """Start the container's command as the pod would (its own session, so the tree dies together).
    `secret_dir` holds the admin Secret's files (write_secret) where the pod mounts builders.ADMIN_DIR."""
    mounts = {builders.CONFIG_DIR: str(config_dir)}
    if secret_dir is not None:
        mounts[builders.ADMIN_DIR] = str(secret_dir)

    def local(text: str) -> str:
        for where, here in mounts.items():
            text = text.replace(where, here)
        return text
    values = {"metadata.name": pod_name, "status.podIP": pod_ip,
              f"metadata.labels['{builders.POD_INDEX_LABEL}']": str(node_rank)}
    env: dict[str, str] = {}
    for e in container["env"]:
        if "valueFrom" in e:
            env[e["name"]] = values[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = local(e["value"])
    argv = [local(expand(a, env)) for a in container["args"]]
    command = [shutil.which(container["command"][0]) or container["command"][0], *container["command"][1:]]
    base = {k: v for k, v in os.environ.items() if not _SCRUB.match(k)}
    proc = subprocess.Popen([*command, *argv], env={**base, **env}, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    return PodProcess(pod_name, pod_ip, proc, log)


def http(url: str, body: dict | None = None, method: str | None = None, timeout: float = 60) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}


def metric(text: str, sample: str) -> float | None:
    """One sample's value from Prometheus text, e.g. `pdrollout:rank_steps_total{node="1",rank="2"}`."""
    m = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def health(url: str) -> tuple[int, dict] | None:
    """(status, body) of /health, or None while nothing listens."""
    try:
        return http(f"{url}/health", timeout=5)
    except OSError:
        return None


def wait_health(pod: PodProcess, url: str, want: int, timeout: float) -> dict:
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        if pod.proc.poll() is not None:
            raise AssertionError(f"{pod.name} exited {pod.proc.returncode} waiting for /health {want}:\n{pod.tail()}")
        last = health(url)
        if last is not None and last[0] == want:
            return last[1]
        time.sleep(0.3)
    raise AssertionError(f"{pod.name}: /health not {want} after {timeout}s (last {last}):\n{pod.tail()}")
