"""Reward scorers: registry, custom-function loading, RewardManager with a timed process pool.

Imports no Ray/Megatron/SGLang. Attributes load lazily so that a spawned scoring worker, which
imports this package, does not pay for torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "register_reward": "mrl.rewards.registry", "get_reward_fn": "mrl.rewards.registry",
    "reward_names": "mrl.rewards.registry",
    "gsm8k": "mrl.rewards.scorers", "arith": "mrl.rewards.scorers", "exact_match": "mrl.rewards.scorers",
    "extract_gsm8k_answer": "mrl.rewards.scorers",
    "RewardManager": "mrl.rewards.manager", "RewardResult": "mrl.rewards.manager",
    "place_on_last_token": "mrl.rewards.manager", "ScoringPool": "mrl.rewards.pool",
    "ScoreContractError": "mrl.rewards.outcome", "parse_return": "mrl.rewards.outcome",
}
__all__ = [
    "RewardManager", "RewardResult", "ScoreContractError", "ScoringPool", "arith", "exact_match",
    "extract_gsm8k_answer", "get_reward_fn", "gsm8k", "parse_return", "place_on_last_token", "register_reward",
    "reward_names",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mrl.rewards' has no attribute {name!r}")
