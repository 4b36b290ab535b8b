"""`pdrollout-operator` / `python -m pdrollout.operator`: run the kopf operator."""
from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os

import kopf


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="pdrollout-operator", description="Run the PDRollout operator.")
    ap.add_argument("-n", "--namespace", action="append", default=[],
                    help="watch only this namespace (repeatable); default: all namespaces")
    ap.add_argument("--liveness", default=None,
                    help="serve kopf's liveness probe here, e.g. http://0.0.0.0:8080/healthz")
    ap.add_argument("--token-key-file", default=os.environ.get("PDROLLOUT_OPERATOR_TOKEN_KEY_FILE"),
                    help="key (>= 32 bytes) the engines' admin tokens derive from; "
                         "default $PDROLLOUT_OPERATOR_TOKEN_KEY_FILE")
    ap.add_argument("--leader-elect", action="store_true",
                    default=os.environ.get("PDROLLOUT_OPERATOR_LEADER_ELECT", "") == "true",
                    help="several replicas: only the holder of a Lease in the operator's namespace acts")
    ap.add_argument("--lease-name", default="pdrollout-operator")
    ap.add_argument("--lease-seconds", type=float,
                    default=float(os.environ.get("PDROLLOUT_OPERATOR_LEASE_S", 15)),
                    help="a leader silent this long is replaced (failover time); it renews every "
                         "lease/7.5 s and gives up at 2/3 of it")
    ap.add_argument("--metrics-address", default=os.environ.get("PDROLLOUT_OPERATOR_METRICS_ADDRESS"),
                    help="serve the operator's Prometheus metrics on HOST:PORT (/metrics), e.g. 0.0.0.0:8081")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.token_key_file:
        os.environ["PDROLLOUT_OPERATOR_TOKEN_KEY_FILE"] = args.token_key_file
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers = importlib.import_module("pdrollout.operator.handlers")  # registers the handlers
    try:   # fail now, with the reason, rather than on the first rollout
        handlers.token_key()
        handlers.operator_namespace()
        handlers.cluster_domain()
    except handlers.SetupError as e:
        ap.error(str(e))

    if args.metrics_address:   # a standby serves it too (empty): its target stays up
        from pdrollout.operator import metrics
        try:
            metrics.serve(args.metrics_address)
        except (ValueError, OSError) as e:
            ap.error(f"--metrics-address {args.metrics_address}: {e}")
    handlers.WATCHED[:] = args.namespace
    elector = lead(args) if args.leader_elect else None
    # Standalone: kopf's own peering stays off; with several replicas the Lease above decides.
    asyncio.run(kopf.operator(standalone=True, namespaces=args.namespace,
                              clusterwide=not args.namespace, liveness_endpoint=args.liveness))
    if elector:   # kopf stopped cleanly (SIGTERM): the next replica need not wait out the lease
        elector.release()


def lead(args):
    """Block as a standby until this replica holds the Lease, then keep it renewed (exit if lost). The
    liveness endpoint answers meanwhile, so the kubelet does not restart a healthy standby."""
    import socket
    from urllib.parse import urlparse

    from kubernetes import client

    from pdrollout.operator import handlers, kube, leader

    identity = os.environ.get("POD_ID") or f"{socket.gethostname()}-{os.getpid()}"
    cfg = leader.LeaseConfig(name=args.lease_name, namespace=handlers.operator_namespace(), identity=identity,
                             lease_s=args.lease_seconds, renew_deadline_s=args.lease_seconds * 2 / 3,
                             retry_s=args.lease_seconds / 7.5)
    elector = leader.LeaderElector(client.CoordinationV1Api(kube.api_client()), cfg)
    probe = _standby_liveness(urlparse(args.liveness)) if args.liveness else None
    try:
        elector.acquire()
    finally:
        if probe:
            probe.shutdown()
            probe.server_close()   # kopf binds the same port next
    elector.keep()
    return elector


def _standby_liveness(url):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Alive(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == url.path else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer((url.hostname, url.port), Alive)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


if __name__ == "__main__":
    main()
