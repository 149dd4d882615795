"""Single-process reference for the worker tests: the same loss on the HF model, full batch.

Independent of Megatron and of the code under test: a plain transformers forward of the batch as stored (its own
index arithmetic, no ``mrl.workers.minibatch`` input builder, no ``gather_response``), full-vocab log_softmax, the
loss written out here (no ``mrl.algorithms``; those functions are checked against verl's own in
tests/algorithms/oracle/), with the batch's own (= global) denominators, autograd. This is the "TP1×PP1, one
micro-batch" truth the layouts are compared against.
"""
from __future__ import annotations

import torch

from mrl.workers.batch import TrainBatch


def hf_padded_log_probs(model, batch: TrainBatch, temperature: float = 1.0, **forward_kwargs):
    """([B, R] log-probs, [B, R] entropies) of the response tokens from one plain transformers forward of the
    batch as stored — left-padded prompts, right-padded responses, its own ``attention_mask`` and
    ``position_ids`` — with no mrl input builder (``build_model_inputs`` is what the worker tests test).

    Index arithmetic: with P prompt columns, response token j of sample i is ``input_ids[i, P + j]`` and the
    logits at column ``P + j − 1`` score it (column P − 1 is the prompt's last token, never padding: prompts
    are left-padded and non-empty). Columns where ``attention_mask`` is 0 (response padding) give 0, as the
    workers report them. ``forward_kwargs`` go to the model's forward (e.g. ``output_router_logits=True``);
    the model's output comes back as a third value when any are given."""
    ids, am = batch.input_ids, batch.attention_mask
    P = ids.shape[1] - batch.responses.shape[1]
    out = model(input_ids=ids, attention_mask=am, position_ids=batch.position_ids, **forward_kwargs)
    logp = torch.log_softmax(out.logits[:, P - 1:-1].float() / temperature, -1)  # [B, R, V]: column P-1+j
    lp = logp.gather(-1, ids[:, P:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    valid = am[:, P:].bool()
    zero = torch.zeros((), dtype=lp.dtype)
    res = (torch.where(valid, lp, zero), torch.where(valid, ent, zero))
    return (*res, out) if forward_kwargs else res


def hf_log_probs(model, batch: TrainBatch, temperature: float = 1.0):
    """([B, R] log-probs, [B, R] entropies), with gradients: :func:`hf_padded_log_probs`."""
    return hf_padded_log_probs(model, batch, temperature)


def _agg(x: torch.Tensor, m: torch.Tensor, mode: str, C: float | None) -> torch.Tensor:
    """Σ over the batch's trained tokens (mask m [B, R]) as each loss_agg_mode defines it (docs/algorithms.md):
    token-mean Σ x·m / Σ m; seq-mean-token-sum Σ_i (Σ_t x·m) / S; seq-mean-token-mean Σ_i (Σ_t x·m / n_i) / S;
    seq-mean-token-sum-norm Σ_i (Σ_t x·m) / (S·C); S = sequences with a trained token, n_i = Σ_t m."""
    per_seq, n = (x * m).sum(-1), m.sum(-1)
    S = (n > 0).sum().clamp(min=1)
    if mode == "token-mean":
        return per_seq.sum() / m.sum().clamp(min=1)
    if mode == "seq-mean-token-sum":
        return per_seq.sum() / S
    if mode == "seq-mean-token-mean":
        return (per_seq / n.clamp(min=1)).sum() / S
    if mode == "seq-mean-token-sum-norm":
        return per_seq.sum() / (S * C)
    raise ValueError(f"reference_impl: no written-out aggregation for {mode!r}")


def ppo_clip_loss(lp, old, adv, mask, *, mode: str, low: float, high: float, c: float | None,
                  C: float | None = None) -> torch.Tensor:
    """PPO's clipped surrogate with dual clip, written out: r = exp(lp − old),
    ℓ = max(−A·r, −A·clip(r, 1 − low, 1 + high)), for A < 0 min(ℓ, −A·c); aggregated by ``mode``."""
    r = torch.exp(lp - old)
    ell = torch.maximum(-adv * r, -adv * r.clamp(1 - low, 1 + high))
    if c is not None:
        ell = torch.where(adv < 0, torch.minimum(ell, -adv * c), ell)
    return _agg(ell, mask, mode, C)


def hf_loss_and_grads(model, batch: TrainBatch, spec) -> tuple[float, dict[str, torch.Tensor]]:
    """The actor's objective PG − entropy_coeff·H + kl_loss_coef·KL(k3) on the HF model (``spec``: an
    ``ActorLossSpec``, read for its knobs only), and its gradient by HF name. Written out for the vanilla PPO loss
    and the k3 (``low_var_kl``) KL estimator, the ones the worker tests use; anything else is refused."""
    if spec.policy_loss != "vanilla" or (spec.use_kl_loss and spec.kl_loss_type not in ("low_var_kl", "k3")):
        raise ValueError(f"reference_impl writes out vanilla PPO and k3 only, not {spec.policy_loss}/{spec.kl_loss_type}")
    if spec.tis_imp_ratio_cap is not None or spec.distill_coef:
        raise ValueError("reference_impl: no TIS or distillation term written out")
    model.zero_grad(set_to_none=True)
    lp, ent = hf_log_probs(model, batch, spec.temperature)
    m = batch.response_mask.float()
    kw = {"mode": spec.loss_agg_mode, "C": spec.norm_constant}
    loss = ppo_clip_loss(lp, batch.old_log_probs, batch.advantages, m, low=spec.clip_ratio_low,
                         high=spec.clip_ratio_high, c=spec.clip_ratio_c, **kw)
    loss = loss - spec.entropy_coeff * _agg(ent, m, **kw)
    if spec.use_kl_loss:
        # k3 = exp(ref − lp) − (ref − lp) − 1, with verl's clamps: log-ratio to [−20, 20], value to [−10, 10]
        d = (batch.ref_log_prob - lp).clamp(-20.0, 20.0)
        loss = loss + spec.kl_loss_coef * _agg((torch.exp(d) - d - 1).clamp(-10.0, 10.0), m, **kw)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if "lm_head.weight" in grads and model.config.tie_word_embeddings:
        grads.pop("lm_head.weight")
    return float(loss.detach()), grads
