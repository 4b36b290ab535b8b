"""The observer's bookkeeping (operator/observer.py): one task per live rollout, and `gone` once a rollout
is no longer listed live (deleted, or marked for deletion), exactly once."""
import asyncio

from pdrollout.operator import observer


def _rollout(name: str, uid: str, deleting: bool = False) -> dict:
    meta = {"name": name, "namespace": "ns", "uid": uid}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-06T00:00:00Z"
    return {"metadata": meta}


async def test_a_rollout_no_longer_listed_live_is_gone_once_and_its_task_stops():
    gone = []
    obs = observer.Observer(lambda **_: None, lambda ns, name, uid: gone.append((ns, name, uid)), [], 3600, 3600)
    obs.track([_rollout("a", "u1"), _rollout("b", "u2")])
    assert sorted(obs.tasks) == ["u1", "u2"] and gone == []
    task_b = obs.tasks["u2"][0]
    obs.track([_rollout("a", "u1"), _rollout("b", "u2", deleting=True)])
    assert gone == [("ns", "b", "u2")] and sorted(obs.tasks) == ["u1"]
    obs.track([_rollout("a", "u1")])
    assert gone == [("ns", "b", "u2")]
    obs.track([])
    assert gone == [("ns", "b", "u2"), ("ns", "a", "u1")] and not obs.tasks
    await asyncio.sleep(0)
    assert task_b.cancelled() or task_b.done()
