"""A rank's step log (--step-log DIR): one JSON line per step it ran, DIR/rank<N>.jsonl."""
from __future__ import annotations

import contextlib
import json
import os
import zlib


def rows_digest(rows) -> str:
    """8 hex of the rows' request ids, order aside (equal sets: equal digests)."""
    return format(zlib.crc32("\n".join(sorted(r.rid for r in rows)).encode()), "08x")


class StepLogError(RuntimeError):
    """The step log (--step-log) could not be written, e.g. its disk is full."""


class StepLog:
    def __init__(self, directory: str, rank: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.rank = rank
        self._file = open(os.path.join(directory, f"rank{rank}.jsonl"), "w")
        self._d_events = None   # CUDA events around this step's D graph replay (timed_d)

    @contextlib.contextmanager
    def timed_d(self, stream):
        """CUDA events around what is enqueued inside on `stream` (the D graph replay and its inputs'
        copy): the step's line gets its time on the GPU as `d_gpu_s`, and the wall less it is the
        host's part (docs/perf/HISTORY.md, eighteenth session)."""
        import torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
        self._d_events = (start, end)

    def _d_gpu_s(self) -> float | None:
        """Seconds on the GPU of this step's D replay; None without one, or while it still runs (a step
        that returns before D's kernels end: --d-async, a P epoch's thread)."""
        events, self._d_events = self._d_events, None
        if events is None or not events[1].query():
            return None
        return events[0].elapsed_time(events[1]) / 1e3

    def write(self, fields: dict) -> None:
        try:
            self._file.write(json.dumps(fields) + "\n")
            self._file.flush()
        except OSError as e:   # a full disk: say which file, the group ends with "error"
            raise StepLogError(f"rank {self.rank}: step log {self._file.name}: {e.strerror or e}") from e

    def step(self, plan, report, work, wall_s: float, p_graph_replays: int | None, group_fields: dict) -> None:
        """One executed step: the plan (`work`: this rank's replica's), what the rank reported, its wall,
        and its D graph replay's time on the GPU (`timed_d`; None: no replay, or not yet complete)."""
        self.write({"step": plan.step, "rank": self.rank, "control": plan.control,
                    "ordering": report.ordering, "rounds": report.rounds,
                    "decode_rows": work.decode_rows, "prefill_tokens": work.prefill_tokens,
                    # which rows, and the keys they attend: two runs of equal row counts can still
                    # differ in both (a closed loop's timing decides who shares a step)
                    "decode_ctx_tokens": sum(r.start + r.length for r in work.decode),
                    "decode_set": rows_digest(work.decode),
                    "p_any": plan.p_any,   # P on any replica: this rank's D waits on it too
                    # a P epoch spanning steps: continued here / still going / finished here
                    "p_flight": plan.p_flight, "p_pending": report.p_pending, "p_done": report.p_done,
                    "graph": report.graph, "wall_s": wall_s, "d_gpu_s": self._d_gpu_s(),
                    "jit_compiles": list(report.jit_compiles),   # kernel names: each stalled the step
                    # P forwards served by P's pieces so far (an epoch's may still be in flight)
                    "p_graph_replays": p_graph_replays, **group_fields})

    def close(self) -> None:
        self._file.close()
