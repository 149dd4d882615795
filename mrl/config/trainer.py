"""Trainer section: run length, checkpoints, validation cadence and logging."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from mrl.config.async_training import AsyncTrainingConfig
from mrl.config.base import Section


class TrainerConfig(Section):
    """Outer-loop settings (verl ``trainer``)."""

    total_epochs: int = Field(1, ge=1, description="Passes over the training prompts (ignored when total_training_steps is set).")
    total_training_steps: int | None = Field(None, ge=1, description="Stop after this many steps; null = total_epochs worth.")
    critic_warmup: int = Field(0, ge=0, description="Steps that update only the critic before the actor starts.")
    save_freq: int = Field(-1, ge=-1, description="Checkpoint every N steps; -1 or 0 disables.")
    test_freq: int = Field(-1, ge=-1, description="Validate every N steps; -1 or 0 disables.")
    val_before_train: bool = Field(False, description="Validate once before the first step.")
    val_only: bool = Field(
        False, description="Validate once (model.path, or the checkpoint a resume loads) and exit without training; "
        "runs in the val_before_train slot as in verl, so it needs val_before_train=true."
    )
    log_val_generations: int = Field(
        0, ge=0, description="(input, output, score) rows of each validation logged to the console and as MLflow artifact val_step<N>.json; 0 = none."
    )
    rollout_data_dir: str | None = Field(
        None, description="Write every training sample of step N to <dir>/N.jsonl (input, output, gts, score, step, "
        "the scorer's extra keys; verl's layout); null = off."
    )
    validation_data_dir: str | None = Field(
        None, description="Write every validation sample to <dir>/N.jsonl, N = the step validated after (0 before "
        "training); same keys as rollout_data_dir plus 'reward'; null = off."
    )
    default_local_dir: str | None = Field(
        "checkpoints/${project_name}/${experiment_name}",
        description="Checkpoint directory; ${project_name}/${experiment_name} are substituted.",
    )
    max_ckpt_to_keep: int | None = Field(None, ge=1, description="Keep only the newest N checkpoints; null keeps all.")
    resume_mode: str = Field("auto", description="auto: newest checkpoint in default_local_dir; disable; or a checkpoint path.")
    logger: list[Literal["console", "mlflow"]] = Field(default_factory=lambda: ["console"], description="Metric sinks: console, mlflow.")
    mlflow_tracking_uri: str = Field("sqlite:///mlruns/mlflow.db", description="MLflow store (no server needed for sqlite).")
    project_name: str = Field("mrl", description="Project (MLflow experiment) name.")
    experiment_name: str = Field("default", description="Run name (MLflow run, checkpoint sub-directory).")
    seed: int = Field(42, ge=0, lt=2**63, description="Global seed of model init, dropout and sampling.")
    async_training: AsyncTrainingConfig = Field(
        default_factory=AsyncTrainingConfig, description="Off-policy schedule: bounded staleness between the rollout producer and the trainer (docs/async.md).")

    @property
    def checkpoint_dir(self) -> str | None:
        """default_local_dir with ${project_name}/${experiment_name} substituted."""
        if not self.default_local_dir:
            return None
        return self.default_local_dir.replace("${project_name}", self.project_name).replace(
            "${experiment_name}", self.experiment_name
        )
