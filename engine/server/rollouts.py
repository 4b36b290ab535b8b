"""Rollout makespan tracking: requests that carry the same rollout id form one rollout; its
makespan is first release -> last completion (docs/WORKLOAD.md). A rollout finishes when the client says
so (`POST /rollout/finish`) or after `idle_s` with no request in flight. Pure: times are passed in."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class _Rollout:
    rollout_id: str
    first_release: float
    last_activity: float
    last_completion: Optional[float] = None
    in_flight: int = 0
    requests: int = 0
    finish_requested: bool = False


class RolloutTracker:
    def __init__(self, idle_s: float = 5.0, on_finished: Callable[[dict], None] = lambda s: None,
                 keep_recent: int = 64):
        self.idle_s = idle_s
        self._on_finished = on_finished
        self._active: dict[str, _Rollout] = {}
        self.recent: deque[dict] = deque(maxlen=keep_recent)

    @property
    def active(self) -> int:
        return len(self._active)

    def released(self, rollout_id: str, now: float) -> None:
        r = self._active.get(rollout_id)
        if r is None:
            r = self._active[rollout_id] = _Rollout(rollout_id, now, now)
        r.in_flight += 1
        r.requests += 1
        r.last_activity = now

    def completed(self, rollout_id: str, now: float) -> Optional[dict]:
        r = self._active.get(rollout_id)
        if r is None:
            return None
        r.in_flight -= 1
        r.last_completion = r.last_activity = now
        if r.in_flight == 0 and r.finish_requested:
            return self._finalize(r)
        return None

    def finish(self, rollout_id: str) -> dict:
        """Client-declared end. With requests still in flight it ends at their last completion."""
        r = self._active.get(rollout_id)
        if r is None:
            for s in reversed(self.recent):
                if s["rollout_id"] == rollout_id:
                    return s
            raise KeyError(rollout_id)
        if r.in_flight > 0:
            r.finish_requested = True
            return {"rollout_id": rollout_id, "finished": False, "in_flight": r.in_flight,
                    "num_requests": r.requests}
        return self._finalize(r)

    def expire(self, now: float) -> list[dict]:
        idle = [r for r in self._active.values() if r.in_flight == 0 and now - r.last_activity >= self.idle_s]
        return [self._finalize(r) for r in idle]

    def _finalize(self, r: _Rollout) -> dict:
        del self._active[r.rollout_id]
        end = r.last_completion if r.last_completion is not None else r.last_activity
        summary = {"rollout_id": r.rollout_id, "finished": True, "makespan_s": end - r.first_release,
                   "num_requests": r.requests}
        self.recent.append(summary)
        self._on_finished(summary)
        return summary
