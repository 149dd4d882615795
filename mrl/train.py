"""Entry point of a training run: validated config -> RL driver (``mrl.driver.run``; docs/driver.md)."""
from __future__ import annotations

from mrl.config import MRLConfig

__all__ = ["run"]


def run(cfg: MRLConfig) -> None:
    """Train ``cfg`` end to end with the RL driver."""
    from mrl.driver import run as driver_run

    driver_run(cfg)
