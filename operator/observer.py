"""The observer: every PDRollout is looked at once per poll period by `handlers.observe` (pods, rank 0's
/health and /metrics, group restarts and updates, live controls, status). A kopf timer did this before, but
kopf puts a finalizer on every object a timer runs for (kopf issue 1074), so uninstalling the chart before
its rollouts left them undeletable, their pods unmanaged and their namespace stuck in Terminating. This
loop needs no finalizer: a rollout that is gone or being deleted is not looked at again, and the garbage
collector removes what it owned."""
from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
from typing import Callable

import kopf

from pdrollout.operator import kube
from pdrollout.operator.models import GROUP, PLURAL, VERSION

log = logging.getLogger("pdrollout.observer")
MEMOS: dict[str, kopf.Memo] = {}   # per rollout UID; the change handlers share it (memo_for)


def memo_for(uid: str, memo: kopf.Memo | None = None) -> kopf.Memo:
    """The rollout's memo: the first one seen (kopf's, from a change handler, or a fresh one) is kept."""
    return MEMOS.setdefault(uid, memo if memo is not None else kopf.Memo())


def forget(uid: str) -> None:
    MEMOS.pop(uid, None)


class Stopped:
    """observe's `stopped`: true once its rollout is going away or the operator stops. An engine request
    already in flight finishes in its thread; observe checks this before writing anything after it."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()


class _ObjectLog(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return f"[{self.extra['rollout']}] {msg}", kwargs


class Observer:
    """Lists the rollouts every `poll_s` and keeps one task per live rollout that calls `observe` every
    `poll_s` (the first `initial_delay_s` after it was first listed). `gone(namespace, name, uid)` is called
    once a rollout is no longer listed live: with no finalizer, kopf's deletion handlers may never see it."""

    def __init__(self, observe: Callable[..., None], gone: Callable[[str, str, str], None], namespaces: list[str],
                 poll_s: float, initial_delay_s: float) -> None:
        self.observe, self.gone, self.namespaces = observe, gone, list(namespaces)
        self.poll_s, self.initial_delay_s = poll_s, initial_delay_s
        self.tasks: dict[str, tuple[asyncio.Task, Stopped]] = {}
        self.seen: dict[str, tuple[str, str]] = {}   # uid -> (namespace, name) of every rollout listed live

    async def run(self) -> None:
        try:
            while True:
                try:
                    rollouts = await asyncio.to_thread(kube.list_rollouts, GROUP, VERSION, PLURAL, self.namespaces)
                except Exception as e:   # an API server restarting, a Role not granted yet: the next period
                    log.warning(f"listing {PLURAL}: {e}")
                else:
                    self.track(rollouts)
                await asyncio.sleep(self.poll_s)
        finally:
            for task, stopped in self.tasks.values():
                stopped.set()
                task.cancel()
            await asyncio.gather(*(task for task, _ in self.tasks.values()), return_exceptions=True)

    def track(self, rollouts: list[dict]) -> None:
        live = {o["metadata"]["uid"]: o["metadata"] for o in rollouts if not o["metadata"].get("deletionTimestamp")}
        for uid in [u for u in self.seen if u not in live]:
            self.gone(*self.seen.pop(uid), uid)
        self.seen.update((uid, (m["namespace"], m["name"])) for uid, m in live.items())
        for uid, (task, stopped) in list(self.tasks.items()):
            if uid not in live or task.done():
                stopped.set()
                task.cancel()
                del self.tasks[uid]
        for uid, meta in live.items():
            if uid not in self.tasks:
                stopped = Stopped()
                task = asyncio.create_task(self._each(meta["namespace"], meta["name"], uid, stopped),
                                           name=f"observe {meta['namespace']}/{meta['name']}")
                self.tasks[uid] = (task, stopped)

    async def _each(self, namespace: str, name: str, uid: str, stopped: Stopped) -> None:
        logger = _ObjectLog(log, {"rollout": f"{namespace}/{name}"})
        await asyncio.sleep(self.initial_delay_s)
        while not stopped:
            try:
                raw = await asyncio.to_thread(kube.get_custom, GROUP, VERSION, PLURAL, namespace, name)
                if raw is None or raw["metadata"]["uid"] != uid or raw["metadata"].get("deletionTimestamp"):
                    stopped.set()
                    return
                body, patch = kopf.Body(raw), kopf.Patch()
                # a thread, as kopf runs a sync handler: the engine requests block; the context carries over
                call = functools.partial(self.observe, spec=body.spec, name=name, namespace=namespace, body=body,
                                         meta=body.meta, status=body.status, memo=memo_for(uid), patch=patch,
                                         logger=logger, stopped=stopped)
                await asyncio.get_running_loop().run_in_executor(None, contextvars.copy_context().run, call)
                if patch.get("status") and not stopped:
                    await asyncio.to_thread(kube.patch_status, GROUP, VERSION, PLURAL, namespace, name, uid,
                                            dict(patch["status"]))
            except asyncio.CancelledError:
                raise
            except kube.NamespaceTerminating as e:   # it goes with its namespace: nothing left to observe
                logger.debug(f"stopped observing: {e}")
                stopped.set()
                return
            except Exception:   # as a failed timer tick: said, and the next period tries again
                logger.exception("observe failed; retrying next period")
            await asyncio.sleep(self.poll_s)

