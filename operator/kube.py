"""The few Kubernetes API calls the operator makes, with API errors mapped to kopf's retry semantics:
server-side apply (idempotent, no resourceVersion, so no conflicts), list and delete pods, read rollouts and
patch their status (the observer's)."""
from __future__ import annotations

import functools
import json

import kopf
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

FIELD_MANAGER = "pdrollout-operator"
_APPLY = "application/apply-patch+yaml"


@functools.cache
def api_client() -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def _clients() -> tuple[client.CoreV1Api, client.AppsV1Api]:
    return client.CoreV1Api(api_client()), client.AppsV1Api(api_client())


class Refused(kopf.PermanentError):
    """The API server refused an object built from the spec (400/422): no retry helps until the spec
    changes. `message` is the API server's own."""

    def __init__(self, what: str, message: str):
        super().__init__(f"{what}: {message}")
        self.message = message


class Forbidden(kopf.TemporaryError):
    """403: the operator's RBAC lacks a grant. Often fixed from outside (a Role created late, a namespace
    added to the chart's watch list), so it is retried, with backoff, rather than given up."""


FORBIDDEN_BACKOFF_S = (5.0, 300.0)   # first retry, cap


class NamespaceTerminating(kopf.TemporaryError):
    """403 with cause NamespaceTerminating: nothing new may be created in a namespace being deleted. Not an
    RBAC gap; the rollout goes with its namespace, so there is nothing to retry."""


def forbidden_delay(retry: int) -> float:
    """Seconds before retry number `retry` (kopf counts from 0): doubling from 5 s, at most 5 min."""
    first, cap = FORBIDDEN_BACKOFF_S
    return min(cap, first * 2 ** min(retry, 16))


def retry_semantics(e: ApiException, what: str) -> Exception:
    """Transient API trouble -> TemporaryError (kopf retries); a rejected object -> PermanentError."""
    message = api_message(e)
    # Server-side apply reports a field it cannot decode (e.g. a bad quantity) as a 500 "failed to
    # convert"; it is as final as a 422.
    if e.status in (400, 422) or (e.status == 500 and message.startswith("failed to convert new object")):
        return Refused(what, message)
    if e.status in (409, 410, 429) or e.status >= 500:
        return kopf.TemporaryError(f"{what}: HTTP {e.status}: {api_message(e)}; retrying", delay=3)
    if e.status == 403 and "NamespaceTerminating" in _causes(e):
        return NamespaceTerminating(f"{what}: the namespace is being deleted (NamespaceTerminating)", delay=10)
    if e.status == 403:
        return Forbidden(f"{what}: HTTP 403: {message} (the operator's RBAC lacks this grant)",
                         delay=FORBIDDEN_BACKOFF_S[0])
    if e.status == 404:
        return kopf.PermanentError(f"{what}: HTTP {e.status}: {api_message(e)}")
    return kopf.TemporaryError(f"{what}: HTTP {e.status}: {api_message(e)}", delay=10)


def _causes(e: ApiException) -> list[str]:
    try:
        return [c.get("reason") for c in (json.loads(e.body).get("details") or {}).get("causes") or []]
    except (TypeError, ValueError, AttributeError):
        return []


def api_message(e: ApiException) -> str:
    try:
        return json.loads(e.body).get("message", e.reason)
    except (TypeError, ValueError):
        return str(e.reason)


def _apply_custom(obj: dict, what: str) -> None:
    group, version = obj["apiVersion"].split("/")
    plural = obj["kind"].lower() + "s"
    try:
        client.CustomObjectsApi(api_client()).patch_namespaced_custom_object(
            group, version, obj["metadata"]["namespace"], plural, obj["metadata"]["name"], obj,
            field_manager=FIELD_MANAGER, force=True, _content_type=_APPLY)
    except ApiException as e:
        if e.status == 404:   # the kind itself is not served: its CRD is missing
            raise Refused(what, f"{obj['apiVersion']} {obj['kind']} is not served by this cluster (gang "
                                f"scheduling needs scheduler-plugins' PodGroup CRD and coscheduling)") from None
        raise retry_semantics(e, what) from None


def _calls(kind: str) -> tuple:
    """(patch, delete) of a namespaced kind the operator writes."""
    core, apps = _clients()
    net, rbac = client.NetworkingV1Api(api_client()), client.RbacAuthorizationV1Api(api_client())
    return {"ConfigMap": (core.patch_namespaced_config_map, core.delete_namespaced_config_map),
            "Service": (core.patch_namespaced_service, core.delete_namespaced_service),
            "Secret": (core.patch_namespaced_secret, core.delete_namespaced_secret),
            "ServiceAccount": (core.patch_namespaced_service_account, core.delete_namespaced_service_account),
            "StatefulSet": (apps.patch_namespaced_stateful_set, apps.delete_namespaced_stateful_set),
            "Deployment": (apps.patch_namespaced_deployment, apps.delete_namespaced_deployment),
            "NetworkPolicy": (net.patch_namespaced_network_policy, net.delete_namespaced_network_policy),
            "Role": (rbac.patch_namespaced_role, rbac.delete_namespaced_role),
            "RoleBinding": (rbac.patch_namespaced_role_binding, rbac.delete_namespaced_role_binding)}[kind]


def _if_present(obj: dict, verb: str, call) -> bool:
    """call(name, namespace) on this object; False when it does not exist."""
    kind, meta = obj["kind"], obj["metadata"]
    try:
        call(meta["name"], meta["namespace"])
    except ApiException as e:
        if e.status == 404:
            return False
        raise retry_semantics(e, f"{verb} {kind} {meta['namespace']}/{meta['name']}") from None
    return True


def delete(obj: dict) -> bool:
    """Delete this object if it exists; True when a delete was sent."""
    return _if_present(obj, "delete", _calls(obj["kind"])[1])


def scale_to_zero(obj: dict) -> bool:
    """Set this workload's replicas to 0; False when it does not exist."""
    patch = _calls(obj["kind"])[0]
    return _if_present(obj, "scale", lambda name, ns: patch(name, ns, {"spec": {"replicas": 0}}))


def apply(obj: dict) -> None:
    """Server-side apply with force: the operator owns every field it sets on its children."""
    kind, meta = obj["kind"], obj["metadata"]
    if kind in ("PodGroup", "PDRollout"):   # a fleet's groups are PDRollouts (fleet_sync.py)
        return _apply_custom(obj, f"apply {kind} {meta['namespace']}/{meta['name']}")
    try:
        _calls(kind)[0](meta["name"], meta["namespace"], obj, field_manager=FIELD_MANAGER, force=True,
                        _content_type=_APPLY)
    except ApiException as e:
        raise retry_semantics(e, f"apply {kind} {meta['namespace']}/{meta['name']}") from None


_JSON_PATCH = "application/json-patch+json"


def foreign(obj: dict, owner_uid: str) -> bool:
    """Whether `obj`'s name is taken by an object this owner does not own (so applying with force would
    take it over, and the garbage collector would delete it with the owner). The probe is a JSON Patch
    whose only op tests the first owner reference: it needs only the patch grant (the operator may not
    read Secrets), never changes the object, and the API server answers 422 when the test fails."""
    kind, meta = obj["kind"], obj["metadata"]
    what = f"check owner of {kind} {meta['namespace']}/{meta['name']}"
    probe = [{"op": "test", "path": "/metadata/ownerReferences/0/uid", "value": owner_uid}]
    args = dict(body=probe, _content_type=_JSON_PATCH, _preload_content=False)   # the body is never read
    try:
        if kind == "PodGroup":
            group, version = obj["apiVersion"].split("/")
            client.CustomObjectsApi(api_client()).patch_namespaced_custom_object(
                group, version, meta["namespace"], "podgroups", meta["name"], **args)
        else:
            _calls(kind)[0](meta["name"], meta["namespace"], **args)
    except ApiException as e:
        if e.status == 404:      # absent (or, for PodGroup, not served: apply says which)
            return False
        if e.status == 422:      # no owner reference, or another owner first
            return True
        raise retry_semantics(e, what) from None
    return False


def list_pods(namespace: str, selector: str) -> list[dict]:
    core, _ = _clients()
    try:
        pods = core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False)
    except ApiException as e:
        raise retry_semantics(e, f"list pods {namespace} {selector}") from None
    return json.loads(pods.data)["items"]


def delete_pods(namespace: str, pods: list[dict]) -> None:
    """Delete exactly these pods (UID precondition: never a replacement created meanwhile)."""
    core, _ = _clients()
    for pod in pods:
        meta = pod["metadata"]
        body = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=meta["uid"]))
        try:
            core.delete_namespaced_pod(meta["name"], namespace, body=body)
        except ApiException as e:
            if e.status in (404, 409):  # already gone, or already replaced: either way not ours to delete
                continue
            raise retry_semantics(e, f"delete pod {namespace}/{meta['name']}") from None



def list_custom(group: str, version: str, plural: str, namespace: str, selector: str) -> list[dict]:
    try:
        got = client.CustomObjectsApi(api_client()).list_namespaced_custom_object(
            group, version, namespace, plural, label_selector=selector)
    except ApiException as e:
        raise retry_semantics(e, f"list {plural} {namespace} {selector}") from None
    return got["items"]


def delete_custom(group: str, version: str, plural: str, namespace: str, name: str, uid: str) -> None:
    """Delete exactly this object (UID precondition); gone already is fine."""
    body = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid))
    try:
        client.CustomObjectsApi(api_client()).delete_namespaced_custom_object(
            group, version, namespace, plural, name, body=body)
    except ApiException as e:
        if e.status not in (404, 409):
            raise retry_semantics(e, f"delete {plural} {namespace}/{name}") from None


def list_rollouts(group: str, version: str, plural: str, namespaces: list[str]) -> list[dict]:
    """Every object of the kind in these namespaces (all namespaces when the list is empty)."""
    api = client.CustomObjectsApi(api_client())
    try:
        if not namespaces:
            return api.list_cluster_custom_object(group, version, plural)["items"]
        return [o for ns in namespaces for o in api.list_namespaced_custom_object(group, version, ns, plural)["items"]]
    except ApiException as e:
        raise retry_semantics(e, f"list {plural}") from None


def get_custom(group: str, version: str, plural: str, namespace: str, name: str) -> dict | None:
    """The object now, or None once it is gone."""
    try:
        return client.CustomObjectsApi(api_client()).get_namespaced_custom_object(group, version, namespace, plural,
                                                                                  name)
    except ApiException as e:
        if e.status == 404:
            return None
        raise retry_semantics(e, f"get {plural} {namespace}/{name}") from None


def patch_status(group: str, version: str, plural: str, namespace: str, name: str, uid: str, status: dict) -> None:
    """A merge patch of the status subresource, of exactly this object (UID precondition: never a successor
    of the same name); gone already is fine."""
    body = {"metadata": {"uid": uid}, "status": status}
    try:
        client.CustomObjectsApi(api_client()).patch_namespaced_custom_object_status(
            group, version, namespace, plural, name, body, _content_type="application/merge-patch+json")
    except ApiException as e:
        if e.status not in (404, 409):
            raise retry_semantics(e, f"patch {plural} {namespace}/{name} status") from None
