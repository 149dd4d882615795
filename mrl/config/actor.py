"""Actor (policy) section: parallel layout, optimizer, PPO/GRPO loss knobs.

Batch units (see docs/config.md): ``ppo_mini_batch_size`` counts PROMPTS as in verl, so one
mini-batch holds ``ppo_mini_batch_size * rollout.n`` samples, split over the actor's DP ranks;
``ppo_micro_batch_size_per_gpu`` counts SAMPLES per DP rank per forward/backward.

Loss (verl's Megatron actor): ``L = PG(ratio, A; clip_ratio_low/high, clip_ratio_c) - entropy_coeff * H
+ kl_loss_coef * KL(pi || pi_ref)``, aggregated over ``[B, T]`` by ``loss_agg_mode``.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from mrl.config.base import Section
from mrl.config.extensions import PluginSpec
from mrl.config.lora import LoraConfig
from mrl.config.moe import MoEConfig
from mrl.config.optim import OptimConfig
from mrl.config.parallel import ParallelConfig

# Names with a "+" are straight-through: forward value of the estimator, gradient of k2 (verl's "+" estimators).
KLType = Literal[
    "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
    "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+", "full",
]
LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# verl's checkpoint contents: model = Megatron weights, optimizer = Adam state + LR schedule,
# extra = the worker's update counter (mini-batch shuffle seed), hf_model = a transformers directory.
CheckpointContent = Literal["model", "optimizer", "extra", "hf_model"]


class CheckpointConfig(Section):
    """What an actor checkpoint holds and what a resume reads (verl ``actor.checkpoint``); layout in docs/checkpoints.md."""

    save_contents: list[CheckpointContent] = Field(
        default_factory=lambda: ["model", "optimizer", "extra"],
        description="Parts written to <ckpt>/global_step_N/actor: model (required), optimizer (+ LR schedule), extra "
        "(update counter), hf_model (a transformers-loadable copy in actor/huggingface).",
    )
    load_contents: list[CheckpointContent] | None = Field(
        None, description="Parts a resume loads (hf_model is ignored: the Megatron weights are loaded); null = "
        "save_contents (verl's ${.save_contents}). Without optimizer, Adam and the LR schedule restart.",
    )

    @property
    def load(self) -> list[str]:
        """load_contents with its default (save_contents) applied."""
        return list(self.save_contents if self.load_contents is None else self.load_contents)


class PolicyLossParamsConfig(Section):
    """Hyper-parameters of the Clip-Cov / KL-Cov losses (verl ``actor.policy_loss.<key>``, same names and defaults)."""

    clip_cov_ratio: float = Field(0.0002, gt=0, le=1, description="clip_cov: fraction of valid tokens whose gradient is dropped.")
    clip_cov_lb: float = Field(1.0, description="clip_cov: lower bound of the covariance of the candidate tokens.")
    clip_cov_ub: float = Field(5.0, description="clip_cov: upper bound of the covariance of the candidate tokens.")
    kl_cov_ratio: float = Field(0.0002, gt=0, le=1, description="kl_cov: fraction of valid tokens (largest covariance) given the KL penalty.")
    ppo_kl_coef: float = Field(0.1, ge=0, description="kl_cov: weight of the |log ratio| penalty on those tokens.")

    @model_validator(mode="after")
    def _bounds(self) -> PolicyLossParamsConfig:
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"actor.policy_loss_params.clip_cov_lb={self.clip_cov_lb} must be < clip_cov_ub="
                             f"{self.clip_cov_ub}; fix: e.g. clip_cov_lb=1.0, clip_cov_ub=5.0")
        return self


class ActorConfig(Section):
    """Policy model trained with a clipped policy-gradient loss (verl ``actor_rollout_ref.actor``)."""

    megatron: ParallelConfig = Field(default_factory=ParallelConfig, description="Megatron parallel layout of the actor.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Actor optimizer and LR schedule.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoint contents (verl actor.checkpoint).")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="Low-rank adapters (rank 0 = off); docs/lora.md.")
    moe: MoEConfig = Field(default_factory=MoEConfig, description="Mixture-of-Experts: routing replay, token dispatcher, "
                           "aux-loss weight (MoE models only; docs/moe.md).")
    use_distributed_optimizer: bool = Field(True, description="Shard Adam state and fp32 master weights over DP ranks (Megatron).")
    ppo_mini_batch_size: int = Field(
        256, ge=1, description="PROMPTS per optimizer step; samples per mini-batch = ppo_mini_batch_size * rollout.n."
    )
    ppo_micro_batch_size_per_gpu: int | None = Field(
        None, ge=1, description="SAMPLES per forward/backward on one DP rank; required unless use_dynamic_bsz."
    )
    use_dynamic_bsz: bool = Field(False, description="Pack micro-batches by token count (ppo_max_token_len_per_gpu) instead of sample count.")
    ppo_max_token_len_per_gpu: int = Field(16384, ge=1, description="TOKENS per micro-batch on one device when use_dynamic_bsz; with context parallelism a micro-batch holds up to this × CP tokens, 1/CP of them on each CP rank (verl's rule).")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each step's batch.")
    shuffle: bool = Field(False, description="Shuffle samples before splitting into mini-batches.")
    clip_ratio_low: float = Field(0.2, ge=0, description="PPO clip epsilon below 1: ratio >= 1 - clip_ratio_low.")
    clip_ratio_high: float = Field(0.2, ge=0, description="PPO clip epsilon above 1: ratio <= 1 + clip_ratio_high (DAPO clip-higher).")
    clip_ratio_c: float = Field(3.0, gt=1, description="Dual-clip constant c (> 1) bounding the loss for negative advantages.")
    entropy_coeff: float = Field(0.0, ge=0, description="Entropy bonus weight: loss -= entropy_coeff * H.")
    use_kl_loss: bool = Field(False, description="Add kl_loss_coef * KL(pi || pi_ref) to the actor loss (GRPO style); needs a reference.")
    kl_loss_coef: float = Field(0.001, ge=0, description="Weight of the KL loss term.")
    kl_loss_type: KLType = Field("low_var_kl", description="KL estimator: kl(k1)|abs|mse(k2)|low_var_kl(k3), '+' suffix = straight-through k2 gradient; 'full' is not supported.")
    loss_agg_mode: LossAggMode = Field("token-mean", description="How [B, T] token losses are reduced to a scalar.")
    policy_loss: PluginSpec = Field("vanilla", description="Policy-loss registry name (verl's names: vanilla = PPO clip, gspo, cispo, sapo, geo_mean = GMPO, clip_cov, kl_cov, dppo_tv, dppo_kl, gpg; reinforce = no clip; docs/algorithms.md) or a plugin 'pkg.module:fn' / 'path/to/file.py:fn' (docs/plugins.md).")
    policy_loss_params: PolicyLossParamsConfig = Field(
        default_factory=PolicyLossParamsConfig, description="clip_cov / kl_cov hyper-parameters (verl actor.policy_loss.<key>).")
    tau_pos: float = Field(1.0, gt=0, description="SAPO gate temperature for tokens with A > 0 (verl actor.tau_pos).")
    tau_neg: float = Field(1.05, gt=0, description="SAPO gate temperature for tokens with A <= 0 (verl actor.tau_neg).")
    tis_imp_ratio_cap: float | None = Field(
        None, gt=0, description="Truncated importance sampling vs rollout log-probs, weight min(ratio, cap); null disables."
    )
    on_policy_shortcut: bool | None = Field(
        None, description="Skip the old-log-prob forward when the update is on-policy (one optimizer step on the whole "
        "batch: ppo_epochs=1, one mini-batch, nothing reads log pi_old before the update): pi_old = pi_theta, so the "
        "update's own detached log-probs are used (exact; docs/driver.md). null = on where that holds, true = required "
        "(mrl plan says why not), false = always recompute.",
    )
    shared_prefix: bool | Literal["auto"] = Field(
        "auto", description="auto: on on CPU when rollout.n >= 2, answers are no longer than prompts "
        "(rollout.max_response_length <= data.max_prompt_length) and a shared row P + n(R-1) is <= 512 tokens, else off "
        "(mrl plan says which and why; mrl/config/auto.py). true: compute each prompt once for its rollout.n samples in the actor's forwards (update, "
        "old and colocated-reference log-probs): one row per prompt, each sample's response in its own masked "
        "segment at its own positions (docs/driver.md, 'Shared prompts'). Same log-probs up to float rounding; fewer tokens "
        "when prompts are long relative to responses. Needs Megatron's local attention (not Transformer Engine).",
    )
    use_remove_padding: bool | Literal["auto"] = Field(
        "auto", description="Padding-free packed micro-batches (verl's use_remove_padding): each micro-batch is one row "
        "of whole sequences, positions restarting at 0 for each, attention never crossing a sequence (mrl's sdpa "
        "attention). Applies to every Megatron forward of the run (actor, reference, critic, teacher; the reward model "
        "scores padded rows). auto: on when each of those roles' attention_backend resolves to sdpa and actor.shared_prefix resolves off (mrl plan says "
        "which and why). Same log-probs and gradients as the padded rows up to float rounding (docs/megatron.md).",
    )
    log_prob_micro_batch_size_per_gpu: int | None = Field(
        None, ge=1, description="SAMPLES per forward when recomputing old log-probs; null = ppo_micro_batch_size_per_gpu."
    )
    recompute_granularity: Literal["full", "selective"] | None = Field(
        None, description="Megatron activation recomputation: full (every layer's activations recomputed in the "
        "backward, one layer at a time: the long-sequence setting) | selective (the core attention only) | null "
        "(keep every activation)."
    )
    freeze_vision_tower: bool = Field(
        True, description="Vision-language models (docs/vision.md): keep the vision tower fixed (no gradient, not in "
        "the optimizer), as most recipes do; false trains it with the decoder. Ignored by text-only models.",
    )
    offload_param: bool = Field(False, description="Move actor weights to CPU while the engines generate.")
    offload_grad: bool = Field(False, description="Move actor gradients to CPU outside the update.")
    offload_optimizer: bool = Field(False, description="Move Adam state to CPU outside the update.")
    logits_chunk_size: int = Field(
        4096, ge=1, description="TOKENS per chunk when computing vocab-parallel log-probs (bounds the [tokens, V/TP] logits)."
    )
