"""Reward section: the scorer that turns (prompt, response, ground truth) into a scalar.

The score is placed on the last response token of ``token_level_scores`` [B, T] (verl's GRPO data flow).
"""
from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from mrl.config.base import Section
from mrl.config.judge import JudgeConfig

# registry name | pkg.module:fn | path/to/file.py:fn
_FUNCTION_RE = re.compile(r"^([A-Za-z_][\w]*|[A-Za-z_][\w.]*:[A-Za-z_]\w*|[^:]+\.py:[A-Za-z_]\w*)$")


class OverlongBufferConfig(Section):
    """DAPO's soft overlong punishment (verl ``reward_model.overlong_buffer``): responses longer than
    ``rollout.max_response_length - len`` tokens lose up to ``penalty_factor`` reward, linearly."""

    enable: bool = Field(False, description="Add the overlong penalty to every score.")
    len: int = Field(0, ge=0, description="Buffer length in TOKENS before rollout.max_response_length where the penalty ramps.")
    penalty_factor: float = Field(1.0, ge=0, description="Penalty at rollout.max_response_length tokens.")


class RewardConfig(Section):
    """Rule/function reward scorer run in a process pool."""

    function: str = Field("gsm8k", description="Registry name, 'pkg.module:fn' or 'path/to/file.py:fn'.")
    timeout_s: float = Field(10.0, gt=0, description="Seconds one scoring call may take before on_error applies.")
    workers: int = Field(4, ge=0, description="Scoring processes; 0 scores in the driver process.")
    on_error: Literal["raise", "zero", "mask"] = Field(
        "raise", description="When scoring fails or times out: raise, score 0, or mask the sample out of the loss."
    )
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig, description="DAPO overlong penalty.")
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="Generative reward model (LLM-as-judge, docs/judge.md).")

    @field_validator("function")
    @classmethod
    def _check_function(cls, v: str) -> str:
        if not _FUNCTION_RE.match(v):
            raise ValueError(
                f"{v!r} is not a registry name, 'pkg.module:fn' or 'path/to/file.py:fn'; "
                "fix: e.g. reward.function=gsm8k or reward.function=my_rewards.py:score"
            )
        return v
