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
