"""Entry point of a training run: validated config -> RL driver (``mrl.driver.run``; docs/driver.md)."""
from __future__ import annotations

from mrl.config import MRLConfig


class UnsupportedConfigError(RuntimeError):
    """A valid config that this build's driver cannot run yet (or whose inputs are missing).

    Raised before any worker, engine or Ray process starts; the message names each key and the fix.
    """


def run(cfg: MRLConfig) -> None:
    """Train ``cfg`` end to end with the RL driver."""
    from mrl.driver import run as driver_run

    driver_run(cfg)
