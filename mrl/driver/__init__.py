"""The RL driver: ``run(cfg)`` builds workers, engines, rewards and tracking, then loops ``step()``."""
from __future__ import annotations

from mrl.config import MRLConfig


def run(cfg: MRLConfig) -> None:
    """Train ``cfg`` end to end (see docs/driver.md); everything started is stopped on exit."""
    from mrl.driver.build import build
    from mrl.driver.trainer import RLTrainer

    with build(cfg) as services:  # derived values: services.plan (mrl.config.run_plan)
        RLTrainer(cfg, services).fit()


__all__ = ["run"]
