"""A rank's step log (--step-log DIR): one JSON line per step it ran, DIR/rank<N>.jsonl."""
from __future__ import annotations

import json
import os


class StepLogError(RuntimeError):
    """The step log (--step-log) could not be written, e.g. its disk is full."""


class StepLog:
    def __init__(self, directory: str, rank: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.rank = rank
        self._file = open(os.path.join(directory, f"rank{rank}.jsonl"), "w")

    def write(self, fields: dict) -> None:
        try:
            self._file.write(json.dumps(fields) + "\n")
            self._file.flush()
        except OSError as e:   # a full disk: say which file, the group ends with "error"
            raise StepLogError(f"rank {self.rank}: step log {self._file.name}: {e.strerror or e}") from e

    def close(self) -> None:
        self._file.close()
