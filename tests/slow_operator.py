"""The operator with a slow API server (tests only): every apply first waits
$PDROLLOUT_TEST_APPLY_PAUSE_S seconds, so a test can kill the operator between two applies of one
reconcile. The shipped operator has no such setting."""
import os
import time

from pdrollout.operator import __main__ as entry
from pdrollout.operator import kube

_apply = kube.apply
PAUSE_S = float(os.environ["PDROLLOUT_TEST_APPLY_PAUSE_S"])


def slow_apply(obj: dict) -> None:
    time.sleep(PAUSE_S)
    _apply(obj)


kube.apply = slow_apply   # handlers call kube.apply through the module

if __name__ == "__main__":
    entry.main()
