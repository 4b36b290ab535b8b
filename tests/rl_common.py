"""Shared by the RL-loop tests: the engine config, the trainer script, checkpoints made by the CLI."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ENGINE = json.dumps({"block_size": 4, "num_blocks": 256})
TRAINER = str(Path(__file__).resolve().parent / "rl_trainer.py")


def checkpoint(out: Path, seed: int) -> str:
    """A random checkpoint as the issue says: `pdrollout checkpoint --config tiny --seed N`."""
    r = subprocess.run([sys.executable, "-m", "pdrollout.engine.cli", "checkpoint", "--config", "tiny",
                        "--seed", str(seed), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return str(out)
