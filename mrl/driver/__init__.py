"""The RL driver: ``run(cfg)`` builds workers, engines, rewards and tracking, then loops ``step()``."""
from __future__ import annotations

from mrl.config import MRLConfig


def run(cfg: MRLConfig) -> None:
    """Train ``cfg`` end to end (see docs/driver.md); everything started is stopped on exit."""
    from mrl.cluster.worker_group import RankDiedError
    from mrl.driver.build import build
    from mrl.driver.trainer import RLTrainer
    from mrl.errors import RunStoppedError

    try:
        with build(cfg) as services:  # derived values: services.plan (mrl.config.run_plan)
            RLTrainer(cfg, services).fit()
    except RankDiedError as e:  # reported after build's teardown: nothing of the run is left running
        raise RunStoppedError(f"{e}; the run stopped and ended every process it started; "
                              f"{resumable(cfg)}") from None
    except RunStoppedError as e:
        if not e.resume_hint:
            raise
        raise RunStoppedError(f"{e}; {resumable(cfg)}") from None


def resumable(cfg: MRLConfig) -> str:
    """Where a new run would resume from: the newest complete checkpoint, or none."""
    from mrl.driver.state import complete_steps, step_dir

    root = cfg.trainer.checkpoint_dir
    steps = complete_steps(root) if root else []
    if not steps:
        return "no checkpoint was saved yet (trainer.save_freq), so a new run starts from model.path"
    how = ("the same command resumes from it (trainer.resume_mode=auto)" if cfg.trainer.resume_mode == "auto"
           else f"resume with trainer.resume_mode=auto or trainer.resume_mode={step_dir(root, steps[-1])}")
    return f"last resumable checkpoint: {step_dir(root, steps[-1])}; {how}"


__all__ = ["run"]
