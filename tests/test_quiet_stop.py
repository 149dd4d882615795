"""A SIGTERM that lands in a finalizer (Ray's handler raises SystemExit there) prints no traceback once a rank
or engine actor installed mrl.quiet_stop's hook; any other exception in a finalizer still prints."""
from __future__ import annotations

import subprocess
import sys

import pytest

# Ray's worker handler raises SystemExit on SIGTERM; the signal arrives while a __del__ runs.
SCRIPT = """
import signal, sys
def ray_like_handler(signum, frame):
    raise SystemExit(1)
signal.signal(signal.SIGTERM, ray_like_handler)
if sys.argv[1] == "hook":
    from mrl.quiet_stop import quiet_stop_in_finalizers
    quiet_stop_in_finalizers()
class Stopped:
    def __del__(self):
        signal.raise_signal(signal.SIGTERM)  # the handler runs inside this finalizer
class Broken:
    def __del__(self):
        raise ValueError("a real bug in a finalizer")
Stopped()
Broken()
print("still running")
"""


@pytest.mark.parametrize("hook", [True, False])
def test_a_stop_in_a_finalizer_prints_no_traceback_other_errors_do(hook: bool) -> None:
    p = subprocess.run([sys.executable, "-c", SCRIPT, "hook" if hook else "none"], capture_output=True, text=True,
                       timeout=60, check=False)
    assert p.returncode == 0 and p.stdout.strip() == "still running", p.stderr
    assert "ValueError: a real bug in a finalizer" in p.stderr  # other finalizer errors still print
    assert ("SystemExit" in p.stderr) is not hook, p.stderr  # without the hook Python prints the stop's traceback
