"""Reward-model section (verl ``reward_model``): a Hugging Face ``*ForSequenceClassification``
checkpoint scores every (prompt, response) in phase ``rm_score``.

``placement: colocated`` (default) runs the RM on the actor's ranks with the actor's Megatron layout
(``actor.megatron``) and groups; ``placement: separate`` gives it ``num_devices`` devices of its own
(after the actor's, verl's ``reward_model`` resource pool): its own Ray worker group,
torch.distributed world and Megatron layout (``megatron``; null = the actor's sizes). With
the actor's tokenizer it scores the batch's token ids as they are; with another tokenizer or chat
template (``model.input_tokenizer`` set, verl's ``_switch_chat_template``) each response is decoded
and the conversation re-rendered with the RM's chat template first. Its score ``rm_score`` [B] becomes
the reward (``combine: rm``, verl's default: its reward manager returns ``rm_scores`` when the
batch has them), is added to the rule score (``combine: rule+rm``), or is left to the reward
function, which receives it as ``extra_info["rm_score"]`` (``combine: function``).
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from mrl.config.base import Section
from mrl.config.side_model import RankSideModelConfig


class RewardModelPathConfig(Section):
    """Where the reward model's weights are (verl ``reward_model.model``)."""

    path: str | None = Field(None, description="HF *ForSequenceClassification checkpoint directory (num_labels=1); "
                             "its tokenizer is the RM's when input_tokenizer is set.")
    input_tokenizer: str | None = Field(
        None, description="verl's input_tokenizer: the ACTOR's tokenizer directory (model.tokenizer_path or model.path) "
        "when the RM's tokenizer or chat template differs from the actor's: responses are decoded with it and "
        "prompt + response re-rendered with the RM's chat template, then tokenized by the RM's tokenizer. "
        "null = the RM shares the actor's tokenizer and scores the batch's token ids as they are.")


class RewardModelConfig(RankSideModelConfig):
    """Model-based reward: on the actor's ranks (colocated) or on devices of its own (separate); its placement,
    layout, offload and micro-batch keys are the side-model base's (mrl/config/side_model.py)."""

    score_head: ClassVar[bool] = True  # *ForSequenceClassification: score.weight [1, H]
    enable: bool = Field(False, description="Score every sample with the reward model (phase rm_score).")
    model: RewardModelPathConfig = Field(default_factory=RewardModelPathConfig, description="Reward model checkpoint.")
    max_length: int | None = Field(
        None, ge=1, description="Tokens of a re-rendered RM input (model.input_tokenizer set), longer ones cut on the "
        "right (verl's truncation; the RM then reads the cut's last token); null = not cut (verl cuts at the actor "
        "batch's padded length, which loses the end of conversations the RM's tokenizer spells in more tokens).")
    combine: Literal["rm", "rule+rm", "function"] = Field(
        "rm", description="rm: the RM score is the reward (reward.function is not called; verl's default); "
        "rule+rm: reward.function's score + the RM score; function: reward.function's score alone, which "
        "sees the RM score as extra_info['rm_score'] (as in the other modes that call it).")

    def model_dir(self) -> str | None:
        return self.model.path
