"""The real-node fixture's sweep of clusters left by killed test runs (tests/real_cluster.py): a
cluster whose recorded processes are all gone is stopped and removed; one with a live process is
another run's and stays."""
from __future__ import annotations

import os
import subprocess
import sys

from real_cluster import sweep_dead_clusters


def _cluster(parent, name: str, pid: int):
    d = parent / name
    (d / "pids").mkdir(parents=True)
    (d / "cluster.env").write_text("CLUSTER_MODE=fake-nodes\n")
    (d / "pids" / "etcd.pid").write_text(f"{pid}\n")
    return d


def test_a_dead_cluster_is_swept_and_a_live_one_kept(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()      # a pid that was this cluster's and is gone now
    dead = _cluster(tmp_path, "pdr-real-dead", p.pid)
    live = _cluster(tmp_path, "pdr-real-live", os.getpid())
    other = tmp_path / "pdr-real-notacluster"      # no cluster.env: not start.sh's, not ours to remove
    other.mkdir()
    assert sweep_dead_clusters(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and other.exists()
    assert (live / "pids" / "etcd.pid").read_text().strip() == str(os.getpid())
