"""A user's plugin file, loaded from config (docs/plugins.md's worked example):

    algorithm.adv_estimator: tests/plugins/difficulty_plugin.py:grpo_difficulty
    actor.policy_loss: tests/plugins/difficulty_plugin.py:clipped_adv
    data.sampler.class_path: tests/plugins/difficulty_plugin.py:easy_first

It imports only mrl's public decorators and helpers, never edits mrl. When a file ``plugin_calls.jsonl`` sits
next to this one (a test copies the plugin into its own directory and makes it) each call appends one JSON line
there, so that the test can see the plugin ran, in the driver and in the Ray workers (which, on a shared Ray
instance, do not inherit the driver's environment).
"""
import json
import os
from pathlib import Path

import torch

from mrl.algorithms import (
    compute_policy_loss_vanilla,
    group_mean_std,
    register_adv_estimator,
    register_policy_loss,
)
from mrl.data.sampler import ResumableSampler, register_sampler


def _log(**record) -> None:
    path = Path(__file__).parent / "plugin_calls.jsonl"
    if path.is_file():
        with open(path, "a") as f:
            f.write(json.dumps({**record, "pid": os.getpid()}) + "\n")


@register_adv_estimator("grpo_difficulty")
@torch.no_grad()
def grpo_difficulty(token_level_rewards, response_mask, *, index=None, extra_info=None, epsilon=1e-6, **unused):
    """GRPO whose groups are difficulty levels instead of prompts.

    ``s_i = sum_t r_it``; with ``d_i = extra_info[i]["difficulty"]`` (the data's per-prompt field,
    passed by keyword by the driver): ``A_i = (s_i - mean_{j: d_j = d_i} s_j) / (std_{d_i} + eps)``
    (unbiased std, a group of one has mean 0, std 1), ``A_it = A_i m_it``; returns = advantages.
    """
    if extra_info is None or any(not e or "difficulty" not in e for e in extra_info):
        raise ValueError("grpo_difficulty needs extra_info['difficulty'] on every prompt; fix: add it to the data")
    difficulty = [str(e["difficulty"]) for e in extra_info]
    scores = token_level_rewards.sum(-1)
    mean, std, _ = group_mean_std(scores, difficulty)
    adv = ((scores - mean) / (std + epsilon)).unsqueeze(-1) * response_mask
    _log(fn="grpo_difficulty", groups=len(set(difficulty)), samples=len(difficulty))
    return adv, adv


@register_policy_loss("clipped_adv")
def clipped_advantage_loss(old_log_prob, log_prob, advantages, response_mask, *, adv_clip=1.0, **kwargs):
    """PPO-clip (``vanilla``) on advantages clamped to ``[-adv_clip, adv_clip]``: no single sample
    moves the policy more than ``adv_clip`` standard deviations' worth."""
    _log(fn="clipped_adv")
    return compute_policy_loss_vanilla(old_log_prob, log_prob, advantages.clamp(-adv_clip, adv_clip),
                                       response_mask, **kwargs)


@register_sampler("easy_first")
class EasyFirstSampler(ResumableSampler):
    """Curriculum: every epoch visits the prompts whose ``extra_info["difficulty"]`` is ``easy``
    first (in the seeded shuffled order), then the others; resumable like the built-in sampler."""

    def __init__(self, num_items, batch_size, *, shuffle=True, seed=1, dataset=None):
        if dataset is None:
            raise ValueError("easy_first needs the dataset (the driver passes it)")
        self.hard = torch.tensor([(p.extra_info or {}).get("difficulty") != "easy" for p in dataset.prompts])
        super().__init__(num_items, batch_size, shuffle=shuffle, seed=seed)

    def _permutation(self, epoch):
        perm = super()._permutation(epoch)
        return perm[torch.argsort(self.hard[perm].long(), stable=True)]

    def next_batch(self):
        out = super().next_batch()
        _log(fn="easy_first", hard=int(self.hard[out].sum()), size=len(out))
        return out


def too_few_arguments(token_level_rewards):
    """Not an estimator: mrl passes the mask and keywords too (a bad-config case)."""
    return token_level_rewards, token_level_rewards
