"""Who may reach a rollout's engines besides the rollout itself and the operator: declared trainer
peers (weight sync: NCCL listens on ephemeral ports, so every port) and the metrics scraper (the HTTP
port). The trainers' ipBlock CIDRs also go to the engine as --admin-peers: requests from them may use
the admin routes (weight updates) without the bearer token."""
from __future__ import annotations

from pdrollout.operator.models import Access, Peer

# Namespaces whose pods may scrape the engines' HTTP port when spec.access.metricsPeers is unset.
METRICS_ACCESS_LABEL = "pdrollout.io/metrics-access"


def _peer(p: Peer) -> dict:
    return p.model_dump(by_alias=True, exclude_none=True, exclude_defaults=False) if p.ip_block is None else \
        {"ipBlock": {"cidr": p.ip_block.cidr, **({"except": p.ip_block.except_} if p.ip_block.except_ else {})}}


def metrics_peers(access: Access) -> list[dict]:
    if access.metrics_peers is None:
        return [{"namespaceSelector": {"matchLabels": {METRICS_ACCESS_LABEL: "true"}}}]
    return [_peer(p) for p in access.metrics_peers]


def trainer_rules(access: Access) -> list[dict]:
    """Ingress rules for the trainers: no `ports`, so every port (NCCL's sockets, and the API)."""
    return [{"from": [_peer(p) for p in access.trainer_peers]}] if access.trainer_peers else []


def admin_peer_args(access: Access) -> list[str]:
    """`--admin-peers CIDR,...` when trainers are declared by address; nothing otherwise."""
    cidrs = [p.ip_block.cidr for p in access.trainer_peers if p.ip_block is not None]
    return ["--admin-peers", ",".join(cidrs)] if cidrs else []
