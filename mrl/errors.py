"""Errors a user's run can stop with before anything expensive starts (a leaf module: the entry
point, the driver and the CLI all import it, and it imports nothing of mrl)."""
from __future__ import annotations


class UnsupportedConfigError(RuntimeError):
    """A valid config that this build's driver cannot run yet (or whose inputs are missing).

    Raised before any worker, engine or Ray process starts; the message names each key and the fix.
    """
