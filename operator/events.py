"""Kubernetes Events on a PDRollout, posted through the API directly: the observer runs outside kopf's
handlers, where kopf's own event queue is not set up. Best effort: a refused event is logged, never
raised (an event into a namespace being deleted gets 403 NamespaceTerminating)."""
from __future__ import annotations

import logging
import socket
from datetime import datetime, timezone

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from pdrollout.operator import kube

COMPONENT = "pdrollout-operator"
MESSAGE_MAX = 1024          # what kubectl describe shows in full; the API allows more
log = logging.getLogger(__name__)


def post(body, *, type: str, reason: str, message: str) -> None:
    meta = body["metadata"]
    now = datetime.now(timezone.utc)
    event = client.CoreV1Event(
        metadata=client.V1ObjectMeta(generate_name=f"{meta['name']}.", namespace=meta["namespace"]),
        involved_object=client.V1ObjectReference(api_version=body["apiVersion"], kind=body["kind"],
                                                 name=meta["name"], namespace=meta["namespace"], uid=meta["uid"]),
        type=type, reason=reason, message=message[:MESSAGE_MAX], count=1, first_timestamp=now, last_timestamp=now,
        source=client.V1EventSource(component=COMPONENT), reporting_component=COMPONENT,
        reporting_instance=socket.gethostname())
    try:
        client.CoreV1Api(kube.api_client()).create_namespaced_event(meta["namespace"], event)
    except ApiException as e:
        log.warning(f"event {reason} on {meta['namespace']}/{meta['name']} not posted: HTTP {e.status} "
                    f"{kube.api_message(e)}")


def warn(body, *, reason: str, message: str) -> None:
    post(body, type="Warning", reason=reason, message=message)


def normal(body, *, reason: str, message: str) -> None:
    post(body, type="Normal", reason=reason, message=message)
