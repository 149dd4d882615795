"""Single-process reference for the worker tests: the same loss on the HF model, full batch.

Independent of Megatron: transformers forward, full-vocab log_softmax, the algorithms library's
loss functions with the batch's own (= global) denominators, autograd. This is the
"TP1×PP1, one micro-batch" truth the layouts are compared against.
"""
from __future__ import annotations

import torch

from mrl.algorithms.agg_loss import agg_loss
from mrl.algorithms.kl import kl_penalty
from mrl.algorithms.policy_loss import get_policy_loss_fn
from mrl.workers.batch import TrainBatch
from mrl.workers.loss import ActorLossSpec
from mrl.workers.minibatch import build_model_inputs


def hf_log_probs(model, batch: TrainBatch, temperature: float = 1.0):
    """([B, R] log-probs, [B, R] entropies) with gradients, from the HF model."""
    mi = build_model_inputs(batch)
    am = (torch.arange(mi.tokens.shape[1])[None] < mi.num_tokens[:, None]).long()
    logits = model(input_ids=mi.tokens, attention_mask=am, position_ids=mi.position_ids).logits.float()
    logp_all = torch.log_softmax(logits / temperature, -1)
    lp = logp_all.gather(-1, mi.labels[..., None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return mi.gather_response(lp), mi.gather_response(ent)


def hf_loss_and_grads(model, batch: TrainBatch, spec: ActorLossSpec) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    lp, ent = hf_log_probs(model, batch, spec.temperature)
    mask = batch.response_mask.float()
    out = get_policy_loss_fn(spec.policy_loss)(
        batch.old_log_probs, lp, batch.advantages, mask, loss_agg_mode=spec.loss_agg_mode,
        clip_ratio_low=spec.clip_ratio_low, clip_ratio_high=spec.clip_ratio_high,
        clip_ratio_c=spec.clip_ratio_c, norm_constant=spec.norm_constant,
    )
    loss = out.pg_loss - spec.entropy_coeff * agg_loss(ent, mask, spec.loss_agg_mode, norm_constant=spec.norm_constant)
    if spec.use_kl_loss:
        loss = loss + spec.kl_loss_coef * agg_loss(
            kl_penalty(lp, batch.ref_log_prob, spec.kl_loss_type), mask, spec.loss_agg_mode,
            norm_constant=spec.norm_constant)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if "lm_head.weight" in grads and model.config.tie_word_embeddings:
        grads.pop("lm_head.weight")
    return float(loss.detach()), grads
