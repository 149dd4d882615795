"""One MoE actor update's objective written out on the transformers model, and its gradient by autograd: the
independent side of the gradient checks in tests/workers/test_moe_actor.py and test_moe_families_actor.py.

Objective (the actor's defaults: ``loss_agg_mode=token-mean``, PPO clip ε = 0.2 both ways, dual clip c = 3, no
entropy or KL term)::

    J = (1/N) Σ_{i,t} m_it · ℓ(r_it, A_it)  +  (1/D) Σ_ranks Σ_layers coef · lb_layer(micro-batch) / k

with r = exp(log π − log π_old), ℓ the clipped surrogate of ``reference_impl.ppo_clip_loss``, log π from one plain
transformers forward of the stored batch (``reference_impl.hf_padded_log_probs``: its own index arithmetic), N the
batch's trained tokens. The aux term is transformers' own ``load_balancing_loss_func`` of each data-parallel rank's
micro-batch (2 samples, each's valid tokens from column 0, right-padded; the padding left out by its
``attention_mask``, as mrl hands Megatron's routers the padding mask), divided by top-k (Megatron's token share is
per token, transformers' per top-k slot), averaged over the D ranks (the DP mean of the gradients). Nothing here
comes from mrl.algorithms or mrl.workers.

Bound (as tests/workers/test_trl_loss.py derives it): both sides compute in float32; each value passes through
D = 5 reductions per layer + 3 (final norm, head, log-sum-exp) of at most K terms (the widest of vocabulary,
hidden and MLP widths), so two implementations agree to ``2·u·D·√K`` relative (u = 2⁻²⁴) — for gradients relative
to each tensor's largest entry, for the loss relative to S = (1/N) Σ m·|ℓ| (its terms' magnitude: the loss is a
small difference of signed terms).
"""
from __future__ import annotations

import torch

from tests.workers.reference_impl import hf_padded_log_probs, ppo_clip_loss

U = 2.0 ** -24
CLIP, DUAL_CLIP = 0.2, 3.0  # ActorConfig's defaults, which the MoE tests' updates run with


def relative_bound(cfg) -> float:
    """2·u·D·√K for the transformers config ``cfg`` (module docstring)."""
    widths = [getattr(cfg, n, 0) or 0 for n in ("vocab_size", "hidden_size", "intermediate_size",
                                                "moe_intermediate_size")]
    return 2 * U * (5 * cfg.num_hidden_layers + 3) * max(widths) ** 0.5


def rank_micro_batches(batch, per_rank: int = 2):
    """Each DP rank's padded micro-batch (``per_rank`` samples, one micro-batch per rank): the samples' valid tokens
    from column 0, right-padded with token 0 to the longest, and which columns hold a token."""
    am = batch.attention_mask.bool()
    for r in range(batch.input_ids.shape[0] // per_rank):
        idx = range(per_rank * r, per_rank * (r + 1))
        n = am[list(idx)].sum(-1)
        rows = torch.zeros(per_rank, int(n.max()), dtype=torch.long)
        for j, i in enumerate(idx):
            rows[j, : n[j]] = batch.input_ids[i][am[i]]
        yield rows, (torch.arange(rows.shape[1]) < n.unsqueeze(1)).long()


def aux_term(model, batch, coef: float, lb_func, per_rank: int = 2) -> tuple[torch.Tensor, float]:
    """(the aux term of J with gradients, the mean per-layer lb/k that mrl reports as moe/load_balancing_loss)."""
    cfg = model.config
    E = next(getattr(cfg, n) for n in ("num_experts", "num_local_experts", "n_routed_experts") if hasattr(cfg, n))
    k = cfg.num_experts_per_tok
    term, vals, ranks = 0.0, [], 0
    for rows, mask in rank_micro_batches(batch, per_rank):
        # right padding under a causal mask: the valid positions' router logits are those of the unpadded rows
        rl = model(input_ids=rows, output_router_logits=True).router_logits
        per_layer = [lb_func((x,), E, k, attention_mask=mask) / k for x in rl]
        vals += [float(v.detach()) for v in per_layer]
        term = term + coef * sum(per_layer)
        ranks += 1
    return term / ranks, sum(vals) / len(vals)


def objective_grads(model, batch, out_dir, *, aux_coef: float = 0.0, lb_func=None) -> dict:
    """{"pg_loss", "scale" (S), "lb" (aux runs), "grads" {checkpoint name: dJ/dθ}} on ``model`` (float32, eval
    mode); ``out_dir``: where :func:`by_checkpoint_name` writes them."""
    model.zero_grad(set_to_none=True)
    lp, _ = hf_padded_log_probs(model, batch)
    m = batch.response_mask.float()
    pg = ppo_clip_loss(lp, batch.old_log_probs, batch.advantages, m, mode="token-mean", low=CLIP, high=CLIP,
                       c=DUAL_CLIP)
    with torch.no_grad():
        r = torch.exp(lp - batch.old_log_probs)
        ell = torch.maximum(-batch.advantages * r, -batch.advantages * r.clamp(1 - CLIP, 1 + CLIP))
        ell = torch.where(batch.advantages < 0, torch.minimum(ell, -batch.advantages * DUAL_CLIP), ell)
        scale = float((ell.abs() * m).sum() / m.sum())
    total, lb = pg, None
    if aux_coef:
        term, lb = aux_term(model, batch, aux_coef, lb_func)
        total = total + term
    total.backward()
    grads = {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
             for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return {"pg_loss": float(pg.detach()), "scale": scale, "lb": lb, "grads": by_checkpoint_name(model, grads, out_dir)}


def by_checkpoint_name(model, grads: dict[str, torch.Tensor], out_dir) -> dict[str, torch.Tensor]:
    """``grads`` (by the model's parameter names) under the checkpoint's tensor names, through transformers' own
    save conversion (its in-memory experts may be fused where the checkpoint stores one tensor per expert, as mrl's
    export does): the gradients are written in place of the weights with ``save_pretrained`` and read back.
    Buffers come back with their values (mrl's side leaves them out)."""
    from pathlib import Path

    from safetensors.torch import load_file

    params = dict(model.named_parameters())
    saved = {n: p.data for n, p in params.items()}
    try:
        for n, p in params.items():
            p.data = grads[n]
        model.save_pretrained(out_dir)
    finally:
        for n, p in params.items():
            p.data = saved[n]
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(out_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def grad_deviation(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """(max over tensors of max|got − want| / max|want|, that tensor's name), over ``got``'s names."""
    missing = set(got) - set(want)
    assert not missing, f"no transformers gradient for {sorted(missing)}"
    rel = {n: float((g.double() - want[n].double()).abs().max()) / max(float(want[n].abs().max()), 1e-12)
           for n, g in got.items()}
    worst = max(rel, key=rel.get)
    return rel[worst], worst
