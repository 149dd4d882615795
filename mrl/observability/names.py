"""Metric names, verl-compatible, so dashboards and habits carry over.

Data metrics (``compute_data_metrics``) are ``<group>/<stat>``; timings ``timing_s/<phase>`` in
seconds; per-update actor/critic statistics ``actor/*`` and ``critic/*`` (averaged over micro-batches).
"""
from __future__ import annotations

STATS = ("mean", "max", "min")

# Sequence-level score from the reward function (sum of token_level_scores) and after KL shaping.
SCORE = "critic/score"
REWARDS = "critic/rewards"
ADVANTAGES = "critic/advantages"
RETURNS = "critic/returns"
VALUES = "critic/values"
VF_EXPLAINED_VAR = "critic/vf_explained_var"
RESPONSE_LENGTH = "response_length"
PROMPT_LENGTH = "prompt_length"
CLIP_RATIO = "clip_ratio"  # fraction of sequences at the length limit (truncated)

# Phases timed with ``timer`` (ARCHITECTURE.md, "One step").
TIMING_PREFIX = "timing_s"
PHASES = ("step", "gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
          "update_weights", "testing", "save_checkpoint")

# Actor / critic update statistics (verl names).
ACTOR_PG_LOSS = "actor/pg_loss"
ACTOR_PG_CLIPFRAC = "actor/pg_clipfrac"
ACTOR_PPO_KL = "actor/ppo_kl"
ACTOR_ENTROPY = "actor/entropy"
ACTOR_KL_LOSS = "actor/kl_loss"
ACTOR_KL_COEF = "actor/kl_coef"
ACTOR_GRAD_NORM = "actor/grad_norm"
ACTOR_LR = "actor/lr"
CRITIC_VF_LOSS = "critic/vf_loss"
CRITIC_VF_CLIPFRAC = "critic/vf_clipfrac"
CRITIC_GRAD_NORM = "critic/grad_norm"
CRITIC_LR = "critic/lr"
KL_PENALTY = "actor/reward_kl_penalty"
KL_PENALTY_COEF = "actor/reward_kl_penalty_coeff"
VAL_SCORE = "val-core/{data_source}/reward/mean@{n}"  # verl's validation score name
PERF_THROUGHPUT = "perf/throughput"  # tokens / s / device
PERF_TOTAL_TOKENS = "perf/total_num_tokens"
PERF_PAD_FRACTION = "perf/pad_fraction"  # padded / computed positions of the actor update (mrl; 0 with packed rows)


def timing(phase: str) -> str:
    """``timing_s/<phase>``."""
    return f"{TIMING_PREFIX}/{phase}"
