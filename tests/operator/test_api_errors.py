"""API errors mapped to what the operator does about them (operator/kube.py): the bodies are the API
server's own Status objects, as kube-apiserver 1.34 sent them in this suite's runs."""
import json

from kubernetes.client.exceptions import ApiException

from pdrollout.operator import kube


def _error(status: int, body: dict) -> ApiException:
    e = ApiException(status=status, reason=body.get("reason"))
    e.body = json.dumps(body)
    return e


TERMINATING = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Forbidden",
               "message": 'pdrollouts.pdrollout.io "fleet-1" is forbidden: unable to create new content in namespace '
                          "r-fleet because it is being terminated",
               "details": {"name": "fleet-1", "group": "pdrollout.io", "kind": "pdrollouts",
                           "causes": [{"reason": "NamespaceTerminating", "field": "metadata.namespace",
                                       "message": "namespace r-fleet is being terminated"}]},
               "code": 403}
RBAC = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Forbidden",
        "message": 'statefulsets.apps "r" is forbidden: User "system:serviceaccount:ops:pdr" cannot patch '
                   'resource "statefulsets" in API group "apps" in the namespace "r-ns"',
        "details": {"name": "r", "group": "apps", "kind": "statefulsets"}, "code": 403}


def test_a_namespace_being_deleted_is_not_an_rbac_gap():
    got = kube.retry_semantics(_error(403, TERMINATING), "apply PDRollout r-fleet/fleet-1")
    assert isinstance(got, kube.NamespaceTerminating) and not isinstance(got, kube.Forbidden)
    assert "NamespaceTerminating" in str(got) and "RBAC" not in str(got)


def test_a_refusal_by_rbac_is_forbidden_and_says_so():
    got = kube.retry_semantics(_error(403, RBAC), "apply StatefulSet r-ns/r")
    assert isinstance(got, kube.Forbidden) and "lacks this grant" in str(got)
    assert not isinstance(kube.retry_semantics(_error(403, {"message": "no body details"}), "x"), kube.NamespaceTerminating)
