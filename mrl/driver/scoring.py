"""The reward phase's one interface, in training and validation: a :class:`SampleScorer` turns a set of
samples into their rewards (``RewardResult``: [B] scores, validity, errors, verl's reward_extra_info).

The step's reward phase (``RLTrainer.reward``) calls ``scorer.train(samples, rule, metrics)``; validation
(``run_validation``) calls ``scorer.validate(samples, rule)`` per chunk of prompts, then
``scorer.val_variables`` once over all of them. ``rule(extra_infos)`` calls ``reward.function`` on the samples
(each sample's ``extra_info`` given, with whatever the scorer adds to it); a scorer decides whether and how
its model's verdict and the rule's combine. One run has one scorer (``RLTrainer``'s ``sample_scorer``):

* :class:`RuleScorer` — ``reward.function`` alone;
* ``RewardModelScorer`` (mrl/driver/rm_reward.py) — ``reward_model``: a classifier's score per sample,
  combined per ``reward_model.combine``;
* ``Judge`` (mrl/driver/judge.py) — ``reward.judge``: a judge model's written verdict per sample, combined
  per ``reward.judge.combine``.

A new model-judged signal is one config section (mrl/config/side_model.py) and one scorer here: the step and
validation do not change. No Ray, no Megatron: what a scorer needs (a side model's call, a client) is passed in.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mrl.rewards.manager import RewardResult
from mrl.workers.batch import TrainBatch

Rule = Callable[[list[dict | None]], RewardResult]  # reward.function on the samples, given their extra_infos


@dataclass
class Samples:
    """What a scorer may read of B samples: their Prompt records (repeated per answer), their decoded responses,
    and their token batch (built on first use: only a scorer that reads token ids asks for it)."""

    prompts: Sequence[Any]
    texts: Sequence[str]
    make_batch: Callable[[], TrainBatch]

    @functools.cached_property
    def batch(self) -> TrainBatch:
        return self.make_batch()

    @property
    def extra_infos(self) -> list[dict | None]:
        return [p.extra_info for p in self.prompts]


class SampleScorer:
    """The reward phase's interface (module doc)."""

    def train(self, samples: Samples, rule: Rule, metrics: dict[str, float]) -> RewardResult:
        """The samples' rewards in a training step; the scorer's metrics (verl's names) go into ``metrics``."""
        raise NotImplementedError

    def validate(self, samples: Samples, rule: Rule) -> tuple[RewardResult, dict[str, torch.Tensor]]:
        """The samples' rewards in validation, scored as in training, and the scorer's own per-sample values
        ([B] each, e.g. the reward model's raw score) for :meth:`val_variables`."""
        raise NotImplementedError

    def val_variables(self, infos: dict[str, list[Any]], own: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
        """Per-sample validation variables the scorer adds once every chunk is scored (``infos``: the reward and
        the rule's keys over all samples; ``own``: :meth:`validate`'s values, concatenated); {} by default."""
        return {}


class RuleScorer(SampleScorer):
    """``reward.function`` alone (no model-judged signal)."""

    def train(self, samples: Samples, rule: Rule, metrics: dict[str, float]) -> RewardResult:
        out = rule(samples.extra_infos)
        metrics.update(out.fault_metrics())  # reward/errors, reward/timeouts, reward/zeroed_samples
        return out

    def validate(self, samples: Samples, rule: Rule) -> tuple[RewardResult, dict[str, torch.Tensor]]:
        return rule(samples.extra_infos), {}
