"""Per-step data metrics on plain tensors (verl ``compute_data_metrics``).

With response_mask m [B, T] and prompt mask [B, P]::

    critic/score/{mean,max,min}     over s_i = sum_t token_level_scores[i, t]         [B]
    critic/rewards/{...}            over sum_t token_level_rewards[i, t]               [B]
    critic/advantages/{...}         over advantages[m == 1] (valid tokens only)
    critic/returns/{...}            over returns[m == 1]
    critic/values/{...}, critic/vf_explained_var = 1 - Var(R - V) / Var(R)  (valid tokens; PPO only)
    response_length/{mean,max,min}  L_i = sum_t m[i, t];  clip_ratio = mean(L_i == T)
    prompt_length/{...}             sum of the prompt mask;  clip_ratio = mean(len == P)

Rollout/trainer agreement (verl ``calculate_debug_metrics``), over the response tokens, with
p_r = exp(engine log-prob) and p_a = exp(actor's recomputed log-prob, same temperature)::

    training/rollout_probs_diff_{max,mean,std}   of |p_a - p_r|
    training/rollout_actor_probs_pearson_corr    Pearson correlation of p_a and p_r
    training/rollout_probs_diff_valid            1, or 0 when there is no response token
"""
from __future__ import annotations

import torch

from mrl.observability import names as N


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    x = x.detach().float()
    if x.numel() == 0:
        return {}
    return {f"{prefix}/mean": x.mean().item(), f"{prefix}/max": x.max().item(), f"{prefix}/min": x.min().item()}


@torch.no_grad()
def compute_data_metrics(*, response_mask: torch.Tensor, token_level_scores: torch.Tensor | None = None,
                         token_level_rewards: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
                         returns: torch.Tensor | None = None, values: torch.Tensor | None = None,
                         prompt_mask: torch.Tensor | None = None, max_response_length: int | None = None,
                         max_prompt_length: int | None = None) -> dict[str, float]:
    """verl-named data metrics of one batch; every tensor but ``response_mask`` [B, T] is optional.

    ``max_response_length`` / ``max_prompt_length`` default to the padded widths T / P.
    """
    m = response_mask.bool()
    out: dict[str, float] = {}
    if token_level_scores is not None:
        out |= _stats(N.SCORE, token_level_scores.sum(-1))
    if token_level_rewards is not None:
        out |= _stats(N.REWARDS, token_level_rewards.sum(-1))
    if advantages is not None:
        out |= _stats(N.ADVANTAGES, advantages[m])
    if returns is not None:
        out |= _stats(N.RETURNS, returns[m])
    if values is not None:
        out |= _stats(N.VALUES, values[m])
        if returns is not None:
            r, v = returns[m].float(), values[m].float()
            var_r = r.var(unbiased=False)
            out[N.VF_EXPLAINED_VAR] = (1.0 - (r - v).var(unbiased=False) / (var_r + 1e-5)).item()
    lengths = m.sum(-1).float()
    out |= _stats(N.RESPONSE_LENGTH, lengths)
    limit = m.shape[-1] if max_response_length is None else max_response_length
    out[f"{N.RESPONSE_LENGTH}/{N.CLIP_RATIO}"] = (lengths >= limit).float().mean().item()
    if prompt_mask is not None:
        plen = prompt_mask.bool().sum(-1).float()
        out |= _stats(N.PROMPT_LENGTH, plen)
        plimit = prompt_mask.shape[-1] if max_prompt_length is None else max_prompt_length
        out[f"{N.PROMPT_LENGTH}/{N.CLIP_RATIO}"] = (plen >= plimit).float().mean().item()
    return out


@torch.no_grad()
def compute_rollout_mismatch_metrics(rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                                     response_mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's sampling distribution is from the trainer's (module docstring): ~1e-6 when
    both compute the same fp32 model; verl's docs call a mean above 0.01 a precision problem."""
    if rollout_log_probs.shape != old_log_probs.shape or old_log_probs.shape != response_mask.shape:
        raise ValueError(f"rollout_log_probs {tuple(rollout_log_probs.shape)}, old_log_probs "
                         f"{tuple(old_log_probs.shape)} and response_mask {tuple(response_mask.shape)} must match")
    m = response_mask.bool()
    pr, pa = rollout_log_probs[m].double().exp(), old_log_probs[m].double().exp()
    if pr.numel() == 0:
        return {"training/rollout_probs_diff_valid": 0.0}
    diff = (pa - pr).abs()
    out = {"training/rollout_probs_diff_valid": 1.0, "training/rollout_probs_diff_max": diff.max().item(),
           "training/rollout_probs_diff_mean": diff.mean().item(),
           "training/rollout_probs_diff_std": diff.std().item() if diff.numel() > 1 else 0.0}
    dr, da = pr - pr.mean(), pa - pa.mean()
    denom = (dr.square().sum() * da.square().sum()).sqrt()
    if denom > 0:  # undefined when either side is constant (e.g. every token sampled with p = 1)
        out["training/rollout_actor_probs_pearson_corr"] = ((dr * da).sum() / denom).item()
    return out


def compute_throughput_metrics(timings: dict[str, float], num_tokens: int, num_devices: int) -> dict[str, float]:
    """verl's perf metrics of one step: ``perf/total_num_tokens`` (prompt + response tokens, all
    samples), ``perf/time_per_step`` = ``timing_s/step`` and ``perf/throughput`` = tokens / (step s x devices)."""
    step_s = timings.get(N.timing("step"))
    if step_s is None:
        raise KeyError("timings has no 'timing_s/step'; fix: wrap the whole step in timer('step', metrics)")
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    return {N.PERF_TOTAL_TOKENS: float(num_tokens), "perf/time_per_step": step_s,
            N.PERF_THROUGHPUT: num_tokens / (step_s * num_devices) if step_s > 0 else 0.0}
