"""`python -m pdrollout.operator.uninstall`: the chart's pre-delete hook. kopf puts a finalizer on every
PDRollout (it needs one to stop its timers); once the chart is gone nothing would remove it, so deleting
a PDRollout, or its namespace, would hang and its GPU pods run on. The hook stops the operator first
(scale to 0 and wait for its pods: a running operator would put the finalizer back), then removes the
finalizer from every PDRollout it watched. The PDRollouts and their pods stay (uninstalling the operator
is not deleting workloads); deleting them afterwards completes at once, the garbage collector taking
their children."""
from __future__ import annotations

import argparse
import json
import sys
import time

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from pdrollout.operator import kube
from pdrollout.operator.models import GROUP, PLURAL, VERSION

FINALIZER = f"{GROUP}/operator"   # handlers.configure sets kopf's finalizer to this


def stop_operator(api: client.ApiClient, namespace: str, deployment: str, selector: str, timeout_s: float) -> None:
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    try:
        apps.patch_namespaced_deployment_scale(deployment, namespace, {"spec": {"replicas": 0}})
    except ApiException as e:
        if e.status != 404:      # no Deployment: nothing runs
            raise
    end = time.monotonic() + timeout_s
    while core.list_namespaced_pod(namespace, label_selector=selector).items:
        if time.monotonic() > end:
            raise SystemExit(f"operator pods ({selector}) in {namespace} still there after {timeout_s:.0f} s")
        time.sleep(1)


def release_finalizers(api: client.ApiClient, namespaces: list[str]) -> list[str]:
    """Remove kopf's finalizer from every PDRollout in `namespaces` (none: all). Returns ns/name of each."""
    custom = client.CustomObjectsApi(api)
    lists = [custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)] if not namespaces else \
        [custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL) for ns in namespaces]
    released = []
    for obj in (o for lst in lists for o in lst["items"]):
        meta = obj["metadata"]
        finalizers = meta.get("finalizers") or []
        if FINALIZER not in finalizers:
            continue
        i = finalizers.index(FINALIZER)
        # The test op: remove exactly ours, even if the list changed since it was read.
        patch = [{"op": "test", "path": f"/metadata/finalizers/{i}", "value": FINALIZER},
                 {"op": "remove", "path": f"/metadata/finalizers/{i}"}]
        try:
            custom.patch_namespaced_custom_object(GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], patch,
                                                  _content_type="application/json-patch+json")
        except ApiException as e:
            if e.status == 404:   # deleted meanwhile
                continue
            raise
        released.append(f"{meta['namespace']}/{meta['name']}")
    return released


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pdrollout.operator.uninstall",
                                 description="Stop the operator and release its finalizers (helm pre-delete).")
    ap.add_argument("--namespace", required=True, help="the operator's namespace")
    ap.add_argument("--deployment", required=True, help="the operator's Deployment")
    ap.add_argument("--selector", required=True, help="label selector of the operator's pods")
    ap.add_argument("--watch", action="append", default=[], help="a watched namespace (repeat); none: all")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the operator's pods")
    args = ap.parse_args(argv)
    api = kube.api_client()
    stop_operator(api, args.namespace, args.deployment, args.selector, args.timeout)
    released = release_finalizers(api, args.watch)
    print(json.dumps({"operatorStopped": True, "finalizersReleased": released}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
