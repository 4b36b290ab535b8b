"""Shared by the RL-loop tests: the engine config, checkpoints made by the CLI, a trainer's POST (the
trainers run under the RL clients' python: tests/rl_clients.py)."""
from __future__ import annotations

import http.client
import json
import subprocess
import sys
import urllib.parse
from pathlib import Path

ENGINE = json.dumps({"block_size": 4, "num_blocks": 256})


def checkpoint(out: Path, seed: int) -> str:
    """A random checkpoint as the issue says: `pdrollout checkpoint --config tiny --seed N`."""
    r = subprocess.run([sys.executable, "-m", "pdrollout.engine.cli", "checkpoint", "--config", "tiny",
                        "--seed", str(seed), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return str(out)


def post(url: str, body: dict, token: str | None = None, source: str | None = None) -> dict:
    """POST JSON as a trainer does; `source` binds the call to that local address (an --admin-peers
    entry). Returns {"status", "body"} whatever the status."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300,
                                      source_address=(source, 0) if source else None)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    try:
        conn.request("POST", u.path, json.dumps(body), headers)
        r = conn.getresponse()
        return {"status": r.status, "body": json.loads(r.read() or b"null")}
    finally:
        conn.close()
