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
    except handlers.SetupError as e:
        ap.error(str(e))

    # Standalone: one replica (the chart uses Recreate), so no peering CRD is needed.
    asyncio.run(kopf.operator(standalone=True, namespaces=args.namespace,
                              clusterwide=not args.namespace, liveness_endpoint=args.liveness))


if __name__ == "__main__":
    main()
