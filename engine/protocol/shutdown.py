"""How long a server takes to stop: shared by the server (serve.py) and the operator, which sizes a
pod's grace period from it (the operator imports only this protocol layer)."""
from __future__ import annotations

ABORT_WAIT_S = 5.0         # after the drain: aborted requests send their final output
RUNNER_SHUTDOWN_S = 5.0    # aiohttp closes the remaining connections
BRIDGE_STOP_S = 10.0       # the engine thread finishes its step and stops


def stop_bound_s(drain_timeout_s: float) -> float:
    """The longest a SIGTERM (or a preStop drain and then SIGTERM) takes to end the server: what a
    pod's grace period must cover so that the kubelet never kills it mid-drain."""
    return drain_timeout_s + ABORT_WAIT_S + RUNNER_SHUTDOWN_S + BRIDGE_STOP_S
