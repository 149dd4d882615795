"""Entry point of a training run: validated config -> RL driver.

The RL driver is ``mrl.driver.run`` (Ray workers, rollout, update loop; docs/driver.md). If an
install lacks it, :func:`run` says so plainly (DriverNotBuiltError) instead of pretending to train.
"""
from __future__ import annotations

import importlib

from mrl.config import MRLConfig

WHAT_RUNS_TODAY = """\
What this build can run today:
  mrl plan CONFIG [key=value ...]     validate a config and print the derived plan (also: make plan)
  mrl train CONFIG [...] --dry-run    the same checks as train, stopping before any worker starts
  mrl engine ...                      the rollout engine server (mrl.rollout.server)
  mrl-ckpt ...                        checkpoint conversion (HF <-> Megatron)
  make test                           the test suite"""


class DriverNotBuiltError(RuntimeError):
    """Raised by :func:`run` while the RL driver is not part of the installed build."""


def run(cfg: MRLConfig) -> None:
    """Run training for ``cfg`` with the RL driver (``mrl.driver.run(cfg)``).

    Raises DriverNotBuiltError (the CLI exits with code 3) when ``mrl.driver`` provides no ``run``.
    """
    try:
        driver = importlib.import_module("mrl.driver")
    except ModuleNotFoundError as e:
        if e.name != "mrl.driver":
            raise  # the driver exists but one of its dependencies is missing: show the real error
        driver = None
    driver_run = getattr(driver, "run", None)
    if driver_run is None:
        raise DriverNotBuiltError(
            "mrl train: the RL driver (rollout -> rewards -> advantages -> actor update -> weight sync loop) is not part "
            "of this build yet, so no training was started. The config above is valid.\n" + WHAT_RUNS_TODAY
        )
    driver_run(cfg)
