"""The operator with a slow API server (tests only): every apply first waits
$PDROLLOUT_TEST_APPLY_PAUSE_S seconds, so a test can kill the operator between two applies of one
reconcile; every pod listing (the status timer's first call) waits $PDROLLOUT_TEST_LIST_PAUSE_S
(default 0), so a timer tick can span a whole reconcile. The shipped operator has no such setting."""
import os
import time

from pdrollout.operator import __main__ as entry
from pdrollout.operator import kube

_apply, _list_pods = kube.apply, kube.list_pods
PAUSE_S = float(os.environ["PDROLLOUT_TEST_APPLY_PAUSE_S"])
LIST_PAUSE_S = float(os.environ.get("PDROLLOUT_TEST_LIST_PAUSE_S", "0"))


def slow_apply(obj: dict) -> None:
    time.sleep(PAUSE_S)
    _apply(obj)


def slow_list_pods(namespace: str, selector: str) -> list[dict]:
    time.sleep(LIST_PAUSE_S)
    return _list_pods(namespace, selector)


# Handlers call these through the module.
kube.apply = slow_apply
kube.list_pods = slow_list_pods

if __name__ == "__main__":
    entry.main()
