"""The pipeline-schedule-aware actor / critic losses (run on the last pipeline stage only).

Actor (verl's Megatron actor ``megatron_actor.py`` ``loss_func``), for one mini-batch M split into
micro-batches m over DP ranks r, with response tensors [b, R] and mask ``M_it``:

    L(M) = PG(M) − entropy_coeff · agg(H) + kl_loss_coef · agg(KL_{kl_loss_type}(log π, log π_ref))
           [+ distill.coef · agg(KL_{distill.estimator}(log π, log π_teacher))   (algorithm.distill.mode=kl_loss)]

PG's token losses are multiplied by the batch's ``rollout_is_weights`` when rollout correction is on
(computed on the whole step batch by the trainer; its rejections are already out of ``response_mask``).

Every ``agg`` is the algorithms library's :func:`~mrl.algorithms.agg_loss.agg_loss` with the
mini-batch's global denominators ``N = Σ_{r,m,i,t} M_it`` (tokens) and ``S = #{i : Σ_t M_it > 0}``
(sequences) — counted once per mini-batch over all micro-batches and DP ranks
(:func:`global_denominators`) — and, for ``seq-mean-token-sum-norm``, Dr.GRPO's constant
``C = rollout.max_response_length`` (``ActorLossSpec.norm_constant``), never the padded width of
the tensors at hand — so ``L(M) = Σ_r Σ_m ℓ_{r,m}`` exactly, for every loss_agg_mode.
Megatron's schedule divides each micro-batch loss by the number of micro-batches n_mb and DDP
averages gradients over the D DP ranks; ``loss_func`` therefore hands back
``ℓ_{r,m} · n_mb · D`` and the accumulated, DP-reduced gradient is exactly ∇L(M): the same at
any TP/PP/DP layout and micro-batch split. See docs/loss_normalisation.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mrl.algorithms.agg_loss import agg_loss
from mrl.algorithms.distill import teacher_kl
from mrl.algorithms.kl import kl_penalty
from mrl.algorithms.policy_loss import PolicyLossParams, get_policy_loss_fn
from mrl.algorithms.value import compute_value_loss
from mrl.megatron.vocab_parallel import vocab_parallel_log_probs
from mrl.workers.megatron_model import MicroBatch

Tensor = torch.Tensor


def global_denominators(micro_batches: list[MicroBatch], model) -> tuple[Tensor, Tensor]:
    """(N tokens, S sequences) of the response mask over all micro-batches and DP ranks."""
    tok = sum(float(mb.data.response_mask.sum()) for mb in micro_batches)
    seq = sum(float((mb.data.response_mask.sum(-1) > 0).sum()) for mb in micro_batches)
    t = torch.tensor([tok, seq], dtype=torch.float64, device=model.device)
    model.all_reduce_dp(t)
    return t[0].clamp(min=1.0).cpu(), t[1].clamp(min=1.0).cpu()


NORM_MODE = "seq-mean-token-sum-norm"


def check_norm_constant(loss_agg_mode: str, norm_constant: float | None, role: str) -> None:
    """Dr.GRPO's ``C`` must be given (and > 0) in ``seq-mean-token-sum-norm``; unused otherwise.

    Falling back to the padded width would make the loss depend on padding and micro-batching.
    """
    if loss_agg_mode != NORM_MODE:
        return
    if norm_constant is None:
        raise ValueError(
            f"{role}.loss_agg_mode={NORM_MODE} needs norm_constant = rollout.max_response_length "
            "(Dr.GRPO's fixed C), got None: pass max_response_length= to the worker"
        )
    if norm_constant <= 0:
        raise ValueError(f"{role}: norm_constant (rollout.max_response_length) must be > 0, got {norm_constant}")


@dataclass
class ActorLossSpec:
    """Loss knobs of one update, built from :class:`mrl.config.actor.ActorConfig` by :meth:`from_config`
    (the config is the single source of the defaults: no config knob has one here).

    ``norm_constant`` is Dr.GRPO's ``C`` for ``seq-mean-token-sum-norm`` (required there, unused
    by the other modes): ``rollout.max_response_length``, the generation budget. ``loss_params``:
    the hyper-parameters of SAPO / Clip-Cov / KL-Cov.
    """

    policy_loss: str
    loss_agg_mode: str
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float | None
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    tis_imp_ratio_cap: float | None
    temperature: float
    norm_constant: float | None
    loss_params: PolicyLossParams
    # algorithm.distill.mode=kl_loss: coef · agg(KL_estimator(log π, log π_teacher)); 0 = no term
    distill_coef: float = 0.0
    distill_estimator: str = "low_var_kl"
    # actor.on_policy_shortcut: log π_old is this forward's own detached log π_θ (the update is the first
    # and only step from π_old), and the micro-batch's log-probs/entropies come back for the driver. The
    # update's mode, not a config knob: set by ActorWorker.update_policy_on_policy.
    on_policy: bool = False

    def __post_init__(self) -> None:
        check_norm_constant(self.loss_agg_mode, self.norm_constant, "actor")

    @classmethod
    def from_config(cls, cfg, temperature: float, *, max_response_length: int | None, distill=None,
                    **overrides) -> ActorLossSpec:
        """``cfg``: the ``actor`` section; ``max_response_length``: ``rollout.max_response_length``;
        ``distill``: ``algorithm.distill`` (its loss term when mode=kl_loss); ``overrides``: fields to replace (tests)."""
        p = cfg.policy_loss_params
        kw = {
            "policy_loss": cfg.policy_loss, "loss_agg_mode": cfg.loss_agg_mode,
            "clip_ratio_low": cfg.clip_ratio_low, "clip_ratio_high": cfg.clip_ratio_high,
            "clip_ratio_c": cfg.clip_ratio_c, "entropy_coeff": cfg.entropy_coeff,
            "use_kl_loss": cfg.use_kl_loss, "kl_loss_coef": cfg.kl_loss_coef,
            "kl_loss_type": cfg.kl_loss_type, "tis_imp_ratio_cap": cfg.tis_imp_ratio_cap,
            "temperature": temperature, "norm_constant": max_response_length,
            "loss_params": PolicyLossParams(
                tau_pos=cfg.tau_pos, tau_neg=cfg.tau_neg, clip_cov_ratio=p.clip_cov_ratio, clip_cov_lb=p.clip_cov_lb,
                clip_cov_ub=p.clip_cov_ub, kl_cov_ratio=p.kl_cov_ratio, ppo_kl_coef=p.ppo_kl_coef),
        }
        if distill is not None and distill.mode == "kl_loss":
            kw |= {"distill_coef": distill.coef, "distill_estimator": distill.estimator}
        return cls(**(kw | overrides))


def response_log_probs(mb: MicroBatch, logits: Tensor, *, tp_group, temperature: float,
                       vocab_size: int, chunk_size: int | None) -> tuple[Tensor, Tensor]:
    """log π(a_t|s_t) and entropy H_t at the response tokens: ([b, R], [b, R]), 0 where invalid.

    ``logits`` [b, L, V/TP] are this TP rank's vocab shard; temperature is applied first so the
    values match the distribution the rollout engine sampled from.
    """
    idx = mb.inputs
    kw = {"tp_group": tp_group, "temperature": temperature, "vocab_size": vocab_size, "chunk_size": chunk_size,
          "with_entropy": True}
    lp, ent = vocab_parallel_log_probs(logits, idx.labels.to(logits.device), **kw)
    first_lp = first_ent = None
    if idx.first_label is not None:  # shared-prefix rows: one prompt column predicts n first tokens
        first_lp, first_ent = vocab_parallel_log_probs(idx.first_token_logits(logits),
                                                       idx.first_label.to(logits.device), **kw)
    return idx.gather_response(lp, first_lp), idx.gather_response(ent, first_ent)


def actor_loss_func(
    mb: MicroBatch, logits: Tensor, *, spec: ActorLossSpec, n_tok: Tensor, n_seq: Tensor,
    scale: float, tp_group, vocab_size: int, chunk_size: int | None,
) -> tuple[Tensor, dict]:
    """Micro-batch term ℓ_{r,m} of L(M), returned multiplied by ``scale`` = n_mb · D.

    Metrics are this micro-batch's additive shares (sum them over micro-batches and DP ranks):
    ``pg_loss``, ``kl_loss``, ``entropy`` (agg of H), ``pg_clipfrac``, ``ppo_kl``,
    ``pg_clipfrac_lower`` (token-means with denominator N), ``distill_loss`` (agg of the teacher KL).
    """
    d = mb.data
    dev = logits.device
    log_prob, entropy = response_log_probs(
        mb, logits, tp_group=tp_group, temperature=spec.temperature, vocab_size=vocab_size,
        chunk_size=chunk_size,
    )
    mask = d.response_mask.to(dev, log_prob.dtype)
    g = {"global_tokens": n_tok.to(dev, log_prob.dtype), "global_seqs": n_seq.to(dev, log_prob.dtype),
         "norm_constant": spec.norm_constant}
    old = log_prob.detach() if spec.on_policy else d.old_log_probs.to(dev, log_prob.dtype)
    out = get_policy_loss_fn(spec.policy_loss)(
        old, log_prob, d.advantages.to(dev, log_prob.dtype), mask,
        loss_agg_mode=spec.loss_agg_mode, clip_ratio_low=spec.clip_ratio_low,
        clip_ratio_high=spec.clip_ratio_high, clip_ratio_c=spec.clip_ratio_c,
        rollout_log_probs=None if d.rollout_log_probs is None else d.rollout_log_probs.to(dev, log_prob.dtype),
        tis_imp_ratio_cap=spec.tis_imp_ratio_cap,
        rollout_is_weights=None if d.rollout_is_weights is None else d.rollout_is_weights.to(dev, log_prob.dtype),
        loss_params=spec.loss_params, **g,
    )
    loss = out.pg_loss
    ent_loss = agg_loss(entropy, mask, spec.loss_agg_mode, **g)
    if spec.entropy_coeff != 0:
        loss = loss - spec.entropy_coeff * ent_loss
    metrics = {
        "pg_loss": out.pg_loss.detach(), "entropy": ent_loss.detach(),
        "pg_clipfrac": out.pg_clipfrac, "ppo_kl": out.ppo_kl, "pg_clipfrac_lower": out.pg_clipfrac_lower,
    }
    if spec.use_kl_loss:
        if d.ref_log_prob is None:
            raise KeyError("use_kl_loss is on but the mini-batch has no ref_log_prob")
        kld = kl_penalty(log_prob, d.ref_log_prob.to(dev, log_prob.dtype), spec.kl_loss_type)
        kl_loss = agg_loss(kld, mask, spec.loss_agg_mode, **g)
        loss = loss + spec.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    if spec.distill_coef:
        if d.teacher_log_prob is None:
            raise KeyError("algorithm.distill.mode=kl_loss but the mini-batch has no teacher_log_prob")
        tkl = agg_loss(teacher_kl(log_prob, d.teacher_log_prob.to(dev, log_prob.dtype), spec.distill_estimator),
                       mask, spec.loss_agg_mode, **g)
        loss = loss + spec.distill_coef * tkl
        metrics["distill_loss"] = tkl.detach()
    metrics["loss"] = loss.detach()
    if spec.on_policy:
        metrics["log_probs"], metrics["entropys"] = log_prob.detach(), entropy.detach()
    return loss * scale, metrics


def log_prob_func(mb: MicroBatch, logits: Tensor, *, temperature: float, tp_group, vocab_size: int,
                  chunk_size: int | None) -> tuple[Tensor, dict]:
    """Forward-only: collect [b, R] log-probs and entropies of the response tokens."""
    with torch.no_grad():
        lp, ent = response_log_probs(mb, logits, tp_group=tp_group, temperature=temperature,
                                     vocab_size=vocab_size, chunk_size=chunk_size)
    return torch.zeros((), device=logits.device), {"log_probs": lp, "entropys": ent}


def response_values(mb: MicroBatch, values: Tensor) -> Tensor:
    """[b, L, 1] per-position values → [b, R]: V(s_t) read at the position before token a_t."""
    return mb.inputs.gather_response(values.squeeze(-1).float())


def critic_loss_func(
    mb: MicroBatch, values: Tensor, *, cliprange_value: float, loss_agg_mode: str, n_tok: Tensor,
    n_seq: Tensor, scale: float, norm_constant: float | None,
) -> tuple[Tensor, dict]:
    """Clipped value loss ``½·agg(max((V−R)², (clip(V, V_old±ε)−R)²))`` share, × ``scale``.

    ``norm_constant``: Dr.GRPO's ``C`` (``rollout.max_response_length``) for
    ``seq-mean-token-sum-norm``; unused by the other modes.
    """
    check_norm_constant(loss_agg_mode, norm_constant, "critic")
    d = mb.data
    dev = values.device
    vpreds = response_values(mb, values)
    mask = d.response_mask.to(dev, vpreds.dtype)
    vf_loss, clipfrac = compute_value_loss(
        vpreds, d.returns.to(dev, vpreds.dtype), d.values.to(dev, vpreds.dtype), mask,
        cliprange_value, loss_agg_mode, global_tokens=n_tok.to(dev, vpreds.dtype),
        global_seqs=n_seq.to(dev, vpreds.dtype), norm_constant=norm_constant,
    )
    vmean = (vpreds.detach() * mask).sum() / n_tok.to(dev, vpreds.dtype)
    return vf_loss * scale, {"vf_loss": vf_loss.detach(), "vf_clipfrac": clipfrac, "vpred_mean": vmean}


def sum_metrics(dicts: list[dict], keys: list[str], model) -> dict[str, float]:
    """Σ over micro-batches (last stage) and DP ranks, then shared with every pipeline stage."""
    t = torch.zeros(len(keys), dtype=torch.float64, device=model.device)
    for d in dicts:
        for i, k in enumerate(keys):
            if k in d:
                t[i] += float(d[k])
    model.all_reduce_dp(t)
    t = model.broadcast_from_last_stage(t)
    return {k: float(t[i]) for i, k in enumerate(keys)}
