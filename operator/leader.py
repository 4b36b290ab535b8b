"""Leader election on a coordination.k8s.io Lease, as client-go does it: several operator replicas, one
acting. A replica acquires the Lease when it is free or its holder stopped renewing it for a whole
lease duration (judged by this replica's own clock: the time it last saw the record change, so clock
skew between pods does not matter), renews it while it acts, and exits at once if it cannot renew
within the deadline (crash-only: the kubelet restarts it as a standby, and two replicas never act
together for longer than the lease). Blocking calls; run before and beside kopf's loop."""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from kubernetes import client
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("pdrollout.leader")


@dataclass(frozen=True)
class LeaseConfig:
    name: str
    namespace: str
    identity: str
    lease_s: float = 15.0       # a holder silent this long is gone
    renew_deadline_s: float = 10.0   # the holder gives up (exits) when it could not renew for this long
    retry_s: float = 2.0        # how often standbys try, and the holder renews


def _now() -> datetime:
    return datetime.now(timezone.utc)


class LeaderElector:
    def __init__(self, api: client.CoordinationV1Api, cfg: LeaseConfig):
        assert cfg.renew_deadline_s < cfg.lease_s, "the holder must give up before others may take over"
        self.api, self.cfg = api, cfg
        self._seen: tuple[str, str] | None = None   # (holder, renewTime) last observed
        self._seen_at = 0.0                          # monotonic time it was first observed

    def _body(self, lease, transitions: int) -> dict:
        now = _now()
        spec = {"holderIdentity": self.cfg.identity, "leaseDurationSeconds": max(1, round(self.cfg.lease_s)),
                "renewTime": now.isoformat(timespec="microseconds"), "leaseTransitions": transitions}
        if lease is None or lease.spec.holder_identity != self.cfg.identity:
            spec["acquireTime"] = spec["renewTime"]
        else:
            spec["acquireTime"] = (lease.spec.acquire_time or now).isoformat(timespec="microseconds")
        meta = {"name": self.cfg.name, "namespace": self.cfg.namespace}
        if lease is not None:
            meta["resourceVersion"] = lease.metadata.resource_version
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this replica holds the Lease afterwards."""
        c = self.cfg
        try:
            lease = self.api.read_namespaced_lease(c.name, c.namespace)
        except ApiException as e:
            if e.status != 404:
                log.warning(f"reading Lease {c.namespace}/{c.name}: HTTP {e.status} {e.reason}")
                return False
            try:
                self.api.create_namespaced_lease(c.namespace, self._body(None, 0))
                return True
            except ApiException as e:   # 409: another replica created it first
                log.info(f"creating Lease {c.namespace}/{c.name}: HTTP {e.status} {e.reason}")
                return False
        holder = lease.spec.holder_identity or ""
        record = (holder, str(lease.spec.renew_time))
        if record != self._seen:
            self._seen, self._seen_at = record, time.monotonic()
        if holder and holder != c.identity and time.monotonic() - self._seen_at < c.lease_s:
            return False   # held, and renewed within a lease duration as far as we can tell
        transitions = (lease.spec.lease_transitions or 0) + (holder != c.identity)
        try:   # resourceVersion: exactly one of several contenders wins
            self.api.replace_namespaced_lease(c.name, c.namespace, self._body(lease, transitions))
            return True
        except ApiException as e:
            if e.status != 409:
                log.warning(f"updating Lease {c.namespace}/{c.name}: HTTP {e.status} {e.reason}")
            return False

    def acquire(self) -> None:
        """Block until this replica holds the Lease."""
        waiting_since, said = time.monotonic(), (None, 0.0)
        while not self.try_acquire_or_renew():
            holder = self._seen[0] if self._seen else "?"
            if holder != said[0] or time.monotonic() - said[1] > 60:   # not every retry
                log.info(f"standby: Lease {self.cfg.namespace}/{self.cfg.name} held by {holder} "
                         f"({time.monotonic() - waiting_since:.0f} s waiting)")
                said = (holder, time.monotonic())
            time.sleep(self.cfg.retry_s)
        log.info(f"leading: acquired Lease {self.cfg.namespace}/{self.cfg.name} as {self.cfg.identity}")

    def release(self) -> None:
        """On a clean exit: hand the Lease over at once instead of after a lease duration."""
        c = self.cfg
        try:
            lease = self.api.read_namespaced_lease(c.name, c.namespace)
            if lease.spec.holder_identity != c.identity:
                return
            body = self._body(lease, lease.spec.lease_transitions or 0)
            body["spec"].update(holderIdentity=None, leaseDurationSeconds=1)
            self.api.replace_namespaced_lease(c.name, c.namespace, body)
            log.info(f"released Lease {c.namespace}/{c.name}")
        except ApiException as e:
            log.warning(f"releasing Lease {c.namespace}/{c.name}: HTTP {e.status} {e.reason}")

    def keep(self, on_lost=None) -> threading.Thread:
        """Renew in a daemon thread; when no renewal succeeded for renew_deadline_s, call on_lost
        (default: exit the process now)."""
        def lost():
            log.error(f"lost Lease {self.cfg.namespace}/{self.cfg.name}: exiting so that another replica leads")
            logging.shutdown()
            os._exit(1)

        def run():
            last_ok = time.monotonic()
            while True:
                time.sleep(self.cfg.retry_s)
                if self.try_acquire_or_renew():
                    last_ok = time.monotonic()
                elif time.monotonic() - last_ok > self.cfg.renew_deadline_s:
                    (on_lost or lost)()
                    return
        t = threading.Thread(target=run, name="pdrollout-lease", daemon=True)
        t.start()
        return t
