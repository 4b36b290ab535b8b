"""The leftover check of tests/conftest.py (`no_leftover_processes`) on real processes: an orphan
of a tree started in its own session (its leader gone, re-parented to init) is found by the test's
token in its environment; a child still running is found; an exempt (higher-scoped fixture's)
tree is not."""
from __future__ import annotations

import subprocess
import sys
import time

from procs import Leftovers, alive, kill_all, wait_gone

ORPHAN = "import subprocess, sys; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True)"


def test_an_orphan_of_a_new_session_is_found_and_an_exempt_tree_is_not():
    exempt = subprocess.Popen(["sleep", "60"])   # as a module fixture's process: before the token
    watch = Leftovers({exempt.pid})
    child = subprocess.Popen(["sleep", "60"])
    leader = subprocess.Popen([sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    orphan = int(leader.stdout.readline())
    leader.wait(10)                 # the leader is gone; its child lives on outside pytest's tree
    time.sleep(0.3)
    try:
        left = watch.stop()
        assert alive(orphan) and orphan in left, (orphan, left)
        assert child.pid in left, (child.pid, left)
        assert exempt.pid not in left
    finally:
        kill_all([orphan, child.pid, exempt.pid])
        child.wait(5)
        exempt.wait(5)
    assert not wait_gone([orphan], 5.0)
