"""Reward-model section (verl ``reward_model``): a Hugging Face ``*ForSequenceClassification``
checkpoint scores every (prompt, response) on the trainer's ranks, in phase ``rm_score``.

The RM is colocated with the actor: the same ranks and Megatron layout (``actor.megatron``), the
same tokenizer (the batch's token ids are scored as they are). Its score ``rm_score`` [B] becomes
the reward (``combine: rm``, verl's default: its reward manager returns ``rm_scores`` when the
batch has them), is added to the rule score (``combine: rule+rm``), or is left to the reward
function, which receives it as ``extra_info["rm_score"]`` (``combine: function``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from mrl.config.base import Section

if TYPE_CHECKING:
    from mrl.config.root import MRLConfig


class RewardModelPathConfig(Section):
    """Where the reward model's weights are (verl ``reward_model.model``)."""

    path: str | None = Field(None, description="HF *ForSequenceClassification checkpoint directory (num_labels=1).")


class RewardModelConfig(Section):
    """Model-based reward on the trainer ranks (colocated with the actor, its TP/PP layout)."""

    enable: bool = Field(False, description="Score every sample with the reward model (phase rm_score).")
    model: RewardModelPathConfig = Field(default_factory=RewardModelPathConfig, description="Reward model checkpoint.")
    micro_batch_size_per_gpu: int = Field(8, ge=1, description="SAMPLES per reward-model forward on one DP rank.")
    combine: Literal["rm", "rule+rm", "function"] = Field(
        "rm", description="rm: the RM score is the reward (reward.function is not called; verl's default); "
        "rule+rm: reward.function's score + the RM score; function: reward.function's score alone, which "
        "sees the RM score as extra_info['rm_score'] (as in the other modes that call it).")


def check_reward_model(cfg: MRLConfig, errors: list[str], notes: list[str]) -> None:
    """Plan-time checks of ``reward_model`` (reads config.json only)."""
    rm = cfg.reward_model
    if not rm.enable:
        return
    if not rm.model.path:
        errors.append("reward_model.enable=true but reward_model.model.path is not set; "
                      "fix: reward_model.model.path=<HF *ForSequenceClassification checkpoint>")
        return
    conf = Path(rm.model.path) / "config.json"
    if not conf.is_file():
        notes.append(f"reward_model.model.path={rm.model.path!r} has no config.json here (yet); the run needs it")
    else:
        try:
            archs = json.loads(conf.read_text()).get("architectures") or []
        except (OSError, ValueError) as e:
            errors.append(f"reward_model.model.path: {conf} is unreadable ({e}); fix: point it at a HF checkpoint")
            return
        if len(archs) != 1 or not archs[0].endswith("ForSequenceClassification"):
            errors.append(f"reward_model.model.path={rm.model.path!r} has architectures {archs}, not a "
                          "*ForSequenceClassification reward model; fix: a checkpoint saved from e.g. "
                          "Qwen2ForSequenceClassification with num_labels=1")
    if cfg.algorithm.adv_estimator == "remax":
        errors.append("reward_model.enable=true with algorithm.adv_estimator=remax: the greedy baseline is scored "
                      "by reward.function only, so baseline and samples would use different rewards; "
                      "fix: another estimator, or reward_model.enable=false")
    par = cfg.actor.megatron
    notes.append(f"reward_model: colocated with the actor (its ranks, TP={par.tensor_model_parallel_size} "
                 f"PP={par.pipeline_model_parallel_size}, micro-batches of {rm.micro_batch_size_per_gpu} samples); "
                 "its weights are not in the memory estimate")
    if rm.combine == "function" and ":" not in cfg.reward.function:
        errors.append(f"reward_model.combine=function but reward.function={cfg.reward.function!r} is a built-in scorer, "
                      "which ignores extra_info['rm_score'] (the RM would not count); fix: reward.function="
                      "path/to/file.py:fn reading extra_info['rm_score'], or reward_model.combine=rm | rule+rm")
    if rm.combine == "rm":
        notes.append(f"reward_model.combine=rm: the reward model's score is the reward; reward.function="
                     f"{cfg.reward.function!r} scores validation only")
