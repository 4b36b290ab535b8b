"""sglang-router, the fleet's load balancer (docs/SERVER.md "A fleet behind sglang-router"): the pinned
release, the image built from it (e2e/cluster/images.sh) and the header its `manual` policy routes by."""
from __future__ import annotations

SGLANG_ROUTER_VERSION = "0.3.2"
# The image images.sh builds from PyPI's wheel; the operator's default for spec.router.
ROUTER_IMAGE = f"pdrollout.local/pdrollout-router:{SGLANG_ROUTER_VERSION}"
# `--policy manual` sends every request carrying one value of this header to one worker (sticky),
# so a session's turns land on the engine holding its prefix; the other policies ignore it.
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
