"""Per-token KL estimators between the policy and the reference policy (verl ``kl_penalty``).

Used for the KL loss in the actor (``use_kl_loss``, verl's Megatron actor) and the KL penalty in the reward
(``use_kl_in_reward``, verl's ray_trainer step). Inputs are the log-probs of the *sampled* tokens, ``[B, T]``.
Estimators from J. Schulman, "Approximating KL divergence" (2020), as verl defines them.
"""
from __future__ import annotations

import torch

_BASE = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_PENALTY_NAMES: tuple[str, ...] = _BASE + tuple(n + "+" for n in _BASE)
"""Every name :func:`kl_penalty` accepts; ``full`` is deliberately absent (see below)."""

_FULL_MSG = (
    "kl_penalty='full' needs the whole-vocabulary distributions of both the policy and the reference "
    "model, but mrl only carries the log-probs of the sampled tokens ([B, T]); set "
    "`kl_loss_type` / `algorithm.kl_penalty` to one of: " + ", ".join(KL_PENALTY_NAMES)
)


def _forward(d: torch.Tensor, name: str) -> torch.Tensor:
    if name in ("kl", "k1"):
        return d
    if name == "abs":
        return d.abs()
    if name in ("mse", "k2"):
        return 0.5 * d.square()
    if name in ("low_var_kl", "k3"):
        # k3 = r - log r - 1 with log r = ref - logprob = -d; clamps for stability as verl does.
        neg = torch.clamp(-d, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(neg) - neg - 1.0, min=-10.0, max=10.0)
    if name == "full":
        raise ValueError(_FULL_MSG)
    raise ValueError(f"unknown kl_penalty {name!r} (config key `kl_loss_type` / `algorithm.kl_penalty`); "
                     f"valid: {', '.join(KL_PENALTY_NAMES)}")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Token-level KL estimate ``[B, T]`` from ``logprob`` and ``ref_logprob`` (both ``[B, T]``).

    With ``d = logprob - ref_logprob`` (log pi_theta - log pi_ref of the sampled token):

    * ``kl`` / ``k1``:         ``d``
    * ``abs``:                 ``|d|``
    * ``mse`` / ``k2``:        ``0.5 * d**2``
    * ``low_var_kl`` / ``k3``: ``exp(-d) + d - 1`` with ``d`` clamped to [-20, 20] and the result
      to [-10, 10] (unbiased and non-negative for KL(pi_theta || pi_ref)).
    * ``<name>+`` (e.g. ``k3+``): straight-through: the forward value of ``<name>`` and the gradient
      of ``k2``, i.e. ``k2 - sg(k2) + sg(<name>)``, whose gradient ``d * grad(logprob)`` is an
      unbiased estimate of the gradient of KL(pi_theta || pi_ref) (verl's "+" variants).

    Source deviations, documented: a widely copied description of verl writes k1 as ``ref - logprob`` and k3 as
    ``where(kl < 0, kl, 0.5 kl^2)``; verl's code computes the definitions above, which we follow.
    ``full`` is refused with a clear message: it needs whole-vocabulary distributions that the
    sampled-token log-probs do not carry.
    """
    d = logprob - ref_logprob
    if kl_penalty.endswith("+"):
        base = kl_penalty[:-1]
        if base not in _BASE:
            _forward(d, base)  # raises the right message ('full' or unknown)
        fwd = _forward(d, base)
        if base in ("mse", "k2"):
            return fwd
        k2 = 0.5 * d.square()
        return k2 - k2.detach() + fwd.detach()
    return _forward(d, kl_penalty)
