"""The chart as the fake-node cluster's tests install it (release, namespace, ServiceAccount), and the engines'
admin tokens derived from the key the chart generated, as the operator derives them."""
from __future__ import annotations

import base64

RELEASE, SYSTEM_NS = "pdr", "pdrollout-system"
OPERATOR_SA = "pdr-pdrollout-operator"


def token_key(cluster) -> bytes:
    """The key the chart generated (Secret <release>-pdrollout-operator-token-key)."""
    sec = cluster.get("secret", f"{OPERATOR_SA}-token-key", "-n", SYSTEM_NS)
    return base64.b64decode(sec["data"]["key"])


def admin_token(cluster, namespace: str, name: str) -> str:
    """A rollout's engine admin token."""
    from pdrollout.operator import builders
    uid = cluster.get("pdrollout", name, "-n", namespace)["metadata"]["uid"]
    return builders.admin_token(token_key(cluster), namespace, name, uid)
