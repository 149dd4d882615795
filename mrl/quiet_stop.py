"""A Ray actor stopped by SIGTERM stops without a traceback on the driver's console.

Ray's SIGTERM handler in a worker raises ``SystemExit``. When the signal lands while Python runs a
finalizer (a weakref callback, a ``__del__``, the garbage collector), the exception cannot propagate:
Python prints "Exception ignored in: ..." with a traceback to the worker's stderr, which Ray forwards to
the driver. A run that stops on an error (``ray.kill`` of its ranks) then ends with a traceback under its
one-line error, though nothing else went wrong (seen in tests/driver/test_faults_e2e.py, a run joined to a
cluster: its ranks are killed while the driver still prints their logs). Only that print is dropped: the
actor goes on stopping as Ray makes it (Ray follows SIGTERM with SIGKILL when a worker does not exit).
"""
from __future__ import annotations

import sys
from typing import Any


def _drop_stop_in_finalizer(unraisable: Any, default=sys.__unraisablehook__) -> None:
    if isinstance(unraisable.exc_value, SystemExit):
        return
    default(unraisable)


def quiet_stop_in_finalizers() -> None:
    """Install the process-wide hook (idempotent); every other unraisable exception prints as before."""
    sys.unraisablehook = _drop_stop_in_finalizer
