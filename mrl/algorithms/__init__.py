"""RL algorithms as pure tensor functions (torch / numpy / stdlib only).

Advantage estimators and policy losses live in registries (``get_adv_estimator`` /
``register_adv_est``, ``get_policy_loss_fn`` / ``register_policy_loss``); the rest are plain
functions. Names follow verl's ``core_algos`` so its users find them. See docs/algorithms.md.
"""
from .advantages import (
    AdvEstimatorFn,
    adv_estimator_names,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    discounted_returns,
    get_adv_estimator,
    group_ids,
    group_mean_std,
    register_adv_est,
    register_adv_estimator,
)
from .agg_loss import LOSS_AGG_MODES, agg_loss, count_tokens_and_seqs
from .dapo import informative_groups, overlong_penalty
from .distill import distill_metrics, reverse_kl_reward, teacher_kl
from .entropy import entropy_from_logits, entropy_from_logits_chunked
from .kl import KL_PENALTY_NAMES, kl_penalty
from .kl_control import (
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    get_kl_controller,
)
from .masked import masked_mean, masked_sum, masked_var, masked_whiten
from .policy_loss import (
    PolicyLossFn,
    PolicyLossOutput,
    compute_policy_loss_gspo,
    compute_policy_loss_reinforce,
    compute_policy_loss_vanilla,
    get_policy_loss_fn,
    policy_loss_names,
    register_policy_loss,
)
from .registry import Registry
from .reward_shaping import (
    SCHEDULES,
    blend_ref_reward,
    repr_align_bonus,
    schedule_weight,
)
from .value import compute_value_loss, explained_variance

__all__ = [
    "KL_PENALTY_NAMES",
    "LOSS_AGG_MODES",
    "SCHEDULES",
    "AdaptiveKLController",
    "AdvEstimatorFn",
    "FixedKLController",
    "KLController",
    "PolicyLossFn",
    "PolicyLossOutput",
    "Registry",
    "adv_estimator_names",
    "agg_loss",
    "apply_kl_penalty",
    "blend_ref_reward",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss_gspo",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_value_loss",
    "count_tokens_and_seqs",
    "discounted_returns",
    "distill_metrics",
    "entropy_from_logits",
    "entropy_from_logits_chunked",
    "explained_variance",
    "get_adv_estimator",
    "get_kl_controller",
    "get_policy_loss_fn",
    "group_ids",
    "group_mean_std",
    "informative_groups",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "policy_loss_names",
    "register_adv_est",
    "register_adv_estimator",
    "register_policy_loss",
    "repr_align_bonus",
    "reverse_kl_reward",
    "schedule_weight",
    "teacher_kl",
]
