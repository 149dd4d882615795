"""Algorithm section: advantage estimator, KL control and reward shaping (verl's estimators and KL, plus reward shaping: docs/driver.md).

* GRPO (verl's GRPO data flow): ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` per uid group of ``rollout.n``
  samples (no std when ``norm_adv_by_std_in_grpo=false``, Dr.GRPO).
* GAE: ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = sum_l (gamma lam)^l delta_{t+l}`` over [B, T].
* KL in reward: ``r_t <- r_t - beta * KL_t`` with beta from ``kl_ctrl``.
* ref_reward_blend (docs/driver.md, "Reward shaping"): ``r <- (1 - w) r + w * minmax(ref_log_prob)`` with w scheduled to max_weight.
* repr_align (docs/driver.md, "Reward shaping"): ``r_t += w * cos(emb_gen, emb_gold) * mask_t / |mask|`` when batch entropy is high.
* filter_groups (DAPO dynamic sampling): train only on groups whose metric has std > 0.
* rollout_correction (verl's ``rollout_corr``): IS weights / rejection masks from ``pi_old / pi_rollout``
  (decoupled PPO; mrl/algorithms/rollout_correction.py, docs/algorithms.md "Rollout correction").
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from mrl.config.actor import KLType
from mrl.config.base import Section
from mrl.config.extensions import PluginSpec
from mrl.rollout_correction_spec import RS_OPTIONS, parse_is_threshold, parse_rs

Schedule = Literal["linear", "sigmoid", "cosine", "exp", "step"]


class KLCtrlConfig(Section):
    """KL coefficient controller for the in-reward KL penalty."""

    type: Literal["fixed", "adaptive"] = Field("fixed", description="fixed: constant kl_coef; adaptive: PPO adaptive controller.")
    kl_coef: float = Field(0.001, ge=0, description="Initial (fixed: constant) KL coefficient beta.")
    target_kl: float = Field(0.1, gt=0, description="Target KL of the adaptive controller.")
    horizon: int = Field(10000, ge=1, description="Horizon (samples) of the adaptive controller.")


class RefRewardBlendConfig(Section):
    """Blend min-max normalised ref_log_prob into token rewards (docs/driver.md, "Reward shaping")."""

    enable: bool = Field(False, description="Turn the blend on (needs a reference model).")
    max_weight: float = Field(0.6, ge=0, le=1, description="Weight w reached at the end of warmup.")
    warmup_ratio: float = Field(0.7, gt=0, le=1, description="Fraction of training over which w rises to max_weight.")
    schedule: Schedule = Field("sigmoid", description="Shape of w over training: linear|sigmoid|cosine|exp|step.")
    steps: int = Field(3, ge=1, description="Number of stairs of the step schedule.")


class RefAlignmentConfig(Section):
    """Cosine similarity of generated vs gold (prompt + ground truth) representations as a bonus (docs/driver.md, "Reward shaping")."""

    enable: bool = Field(True, description="Use the reference alignment bonus when repr_align is on.")
    max_weight: float = Field(0.2, ge=0, le=1, description="Bonus weight reached at the end of warmup.")
    warmup_ratio: float = Field(0.7, gt=0, le=1, description="Fraction of training over which the weight rises.")
    schedule: Schedule = Field("sigmoid", description="Weight schedule: linear|sigmoid|cosine|exp|step.")
    entropy_high_threshold: float = Field(1.0, ge=0, description="Apply only when the batch mean entropy is at least this.")


class ReprAlignConfig(Section):
    """Representation-alignment reward shaping (docs/driver.md, "Reward shaping")."""

    enable: bool = Field(False, description="Turn representation alignment on.")
    ref_alignment: RefAlignmentConfig = Field(default_factory=RefAlignmentConfig, description="Gold-representation alignment term.")


class FilterGroupsConfig(Section):
    """DAPO dynamic sampling (verl ``algorithm.filter_groups``): drop the groups whose ``metric`` is
    the same for every sample (no advantage signal) and generate more prompts until
    ``data.train_batch_size`` informative groups are collected."""

    enable: bool = Field(False, description="Turn dynamic sampling on (needs rollout.n > 1).")
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] | None = Field(
        None, description="Per-sample value whose spread decides: acc (the scorer's 'acc' key), score (the reward "
        "before shaping), seq_reward (sum of token_level_scores), seq_final_reward (sum of token_level_rewards).",
    )
    max_num_gen_batches: int = Field(
        0, ge=0, description="Generation rounds per step at most (data.gen_batch_size prompts each); 0 = no limit.")


class RolloutCorrectionConfig(Section):
    """Correction of the engine/trainer policy mismatch (verl ``algorithm.rollout_correction``, same keys):
    importance weights ``rho = pi_old / pi_rollout`` on the policy loss and/or rejection of tokens and
    sequences whose ratio leaves a trust region. Decoupled PPO: pi_old is recomputed by the trainer,
    pi_rollout is what the engine reported. Off unless rollout_is or rollout_rs is set. docs/algorithms.md."""

    rollout_is: Literal["token", "sequence"] | None = Field(
        None, description="IS weight level: token (w_t = rho_t, truncated: biased, low variance), sequence "
        "(w = prod_t rho_t per sequence: unbiased, high variance); null = no weights (rejection/metrics only).")
    rollout_is_threshold: float | str = Field(
        2.0, description="U (TIS: w <- min(w, U)) or the string 'L_U' (IcePop: w <- 0 outside [L, U]), e.g. 2.0 or "
        "'0.5_5.0'.")
    rollout_is_batch_normalize: bool = Field(
        False, description="Divide the weights by their batch mean (tokens, or sequences for rollout_is=sequence).")
    rollout_rs: str | None = Field(
        None, description="Rejection (masked IS): comma-separated options, all must pass: token_k1|token_k2|token_k3|"
        "seq_sum_k1..k3|seq_mean_k1..k3|seq_max_k2|seq_max_k3 on k1 = -log rho, k2 = (log rho)^2/2, "
        "k3 = rho - 1 - log rho; seq_mean_k1 = geometric-mean sequence ratio. Rejected tokens leave the loss.")
    rollout_rs_threshold: float | str | None = Field(
        None, description="One threshold for all rollout_rs options or one per option (comma-separated): k1 options "
        "'L_U' ratio bounds (a single U means [1/U, U]), the others an upper bound > 0.")
    bypass_mode: bool = Field(
        False, description="verl's bypass mode (pi_old := pi_rollout, no recomputation): not supported, mrl always "
        "recomputes pi_old (decoupled mode); must be false.")
    loss_type: Literal["ppo_clip", "reinforce"] = Field(
        "ppo_clip", description="verl's bypass-mode loss; only used with bypass_mode, so it must stay ppo_clip.")

    @property
    def enabled(self) -> bool:
        """Weights or rejection are on (the trainer then needs the engines' log-probs)."""
        return self.rollout_is is not None or self.rollout_rs is not None

    @model_validator(mode="after")
    def _check(self) -> RolloutCorrectionConfig:
        k = "algorithm.rollout_correction"
        if self.bypass_mode:
            raise ValueError(f"{k}.bypass_mode=true is not supported: mrl recomputes pi_old with the trainer "
                             f"(decoupled mode); fix: {k}.bypass_mode=false")
        if self.loss_type != "ppo_clip":
            raise ValueError(f"{k}.loss_type={self.loss_type} only applies with bypass_mode=true, which mrl does not "
                             f"support; fix: remove {k}.loss_type (the loss is actor.policy_loss)")
        if self.rollout_is is not None:
            parse_is_threshold(self.rollout_is_threshold, f"{k}.rollout_is_threshold")
        elif self.rollout_is_batch_normalize:
            raise ValueError(f"{k}.rollout_is_batch_normalize=true needs {k}.rollout_is (token or sequence); "
                             f"fix: set {k}.rollout_is or remove rollout_is_batch_normalize")
        if self.rollout_rs is not None:
            parse_rs(self.rollout_rs, self.rollout_rs_threshold, k)
        elif self.rollout_rs_threshold is not None:
            raise ValueError(f"{k}.rollout_rs_threshold is set but {k}.rollout_rs is null, so it would be ignored; "
                             f"fix: set {k}.rollout_rs (one of {', '.join(RS_OPTIONS)}) or remove the threshold")
        return self


class DistillConfig(Section):
    """On-policy distillation from ``teacher`` (docs/distillation.md). With ``d_t = log π_student(a_t|s_t) −
    log π_teacher(a_t|s_t)`` on the student's own sampled tokens:

    * ``reverse_kl_reward``: per-token reward ``r_t += −coef · d_t`` (with π_student = π_old), added to the task
      reward before the advantage estimator (GRPO sums it per sequence, REINFORCE++ discounts it per token);
      ``E_π[d_t]`` is the reverse KL(π_student ‖ π_teacher), so maximising the reward minimises it.
    * ``kl_loss``: ``L += coef · agg(KL_estimator(log π_θ, log π_teacher))`` in the actor loss, next to PG and
      the reference KL (estimator k1|k2|k3 as ``actor.kl_loss_type``)."""

    mode: Literal["none", "reverse_kl_reward", "kl_loss"] = Field(
        "none", description="none | reverse_kl_reward (dense reward -coef*(log pi_student - log pi_teacher)) | "
        "kl_loss (coef * KL(pi_theta || pi_teacher) in the actor loss); needs teacher.enable.")
    coef: float = Field(1.0, gt=0, description="Weight of the distillation reward or loss term.")
    estimator: KLType = Field("low_var_kl", description="kl_loss's KL estimator: kl(k1)|abs|mse(k2)|low_var_kl(k3), "
                              "'+' = straight-through k2 gradient (reverse_kl_reward always uses k1, d_t itself).")
    task_reward_coef: float = Field(1.0, ge=0, description="Weight of the task reward (reward.function / reward model) in "
                                    "training while distilling; 0 = pure distillation. Validation always reports the "
                                    "task reward itself.")


class AlgorithmConfig(Section):
    """Advantage estimation and reward-side KL (verl ``algorithm``)."""

    adv_estimator: PluginSpec = Field(
        "grpo", description="Advantage estimator registry name (grpo, gae, rloo, reinforce_plus_plus, "
        "reinforce_plus_plus_baseline, remax, grpo_passk, opo, gpg) or a plugin 'pkg.module:fn' / 'path/to/file.py:fn' (docs/plugins.md)."
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor (GAE, REINFORCE++).")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    norm_adv_by_std_in_grpo: bool = Field(True, description="Divide GRPO advantages by the group std (false = Dr.GRPO).")
    use_kl_in_reward: bool = Field(False, description="Subtract beta * KL(pi_old || pi_ref) from token rewards; needs a reference.")
    allow_double_kl: bool = Field(False, description="Permit use_kl_in_reward together with actor.use_kl_loss (KL applied twice).")
    kl_penalty: KLType = Field("kl", description="KL estimator in the reward: kl(k1)|abs|mse(k2)|low_var_kl(k3).")
    kl_ctrl: KLCtrlConfig = Field(default_factory=KLCtrlConfig, description="KL coefficient controller.")
    ref_reward_blend: RefRewardBlendConfig = Field(default_factory=RefRewardBlendConfig, description="Reference log-prob reward blend.")
    repr_align: ReprAlignConfig = Field(default_factory=ReprAlignConfig, description="Representation alignment shaping.")
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig, description="DAPO dynamic sampling.")
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig, description="Engine/trainer mismatch correction (verl rollout_corr).")
    distill: DistillConfig = Field(default_factory=DistillConfig, description="On-policy distillation from the teacher.")
