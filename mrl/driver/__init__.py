"""The RL driver: ``run(cfg)`` builds workers, engines, rewards and tracking, then loops ``step()``."""
from __future__ import annotations

from mrl.config import MRLConfig


def run(cfg: MRLConfig) -> None:
    """Train ``cfg`` end to end (see docs/driver.md); everything started is stopped on exit."""
    from mrl.driver.build import build
    from mrl.driver.trainer import RLTrainer

    # LR-schedule length in optimizer steps: steps x mini-batches per step x ppo_epochs
    # (None = constant schedule when the run length is given in epochs).
    steps = cfg.trainer.total_training_steps
    mini = max(1, cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size) * cfg.actor.ppo_epochs
    with build(cfg, total_optimizer_steps=steps * mini if steps else None) as services:
        RLTrainer(cfg, services).fit()


__all__ = ["run"]
