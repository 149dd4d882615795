"""A step whose loss or gradient norm is not finite stops the run (issue 33: a resume from corrupted
weights trained on NaN for its whole length and exited 0 with score 0).

Megatron skips an optimizer step on inf/nan gradients, which fp16's dynamic loss scale relies on (an
overflow there is routine and the scale backs off), so under fp16 only the losses stop the run; under
bf16/fp32 a non-finite gradient norm means the weights or the batch hold inf/nan."""
from __future__ import annotations

import math

from mrl.observability import names as N

_LOSSES = (N.ACTOR_PG_LOSS, N.CRITIC_VF_LOSS, "actor/entropy", "actor/kl_loss")
_GRAD_NORMS = (N.ACTOR_GRAD_NORM, N.CRITIC_GRAD_NORM)


class NonFiniteError(RuntimeError):
    """The update produced a non-finite loss or gradient norm; the message names them and the step."""


def stop_if_not_finite(metrics: dict[str, float], step: int, *, fp16: bool) -> None:
    keys = _LOSSES + (() if fp16 else _GRAD_NORMS)
    bad = {k: metrics[k] for k in keys if k in metrics and not math.isfinite(float(metrics[k]))}
    if bad:
        what = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise NonFiniteError(
            f"step {step}: {what}; the run stops rather than train on it (nothing of this step was saved). "
            "Likely causes: corrupted or diverged weights (check the checkpoint with `mrl-ckpt inspect`, resume from "
            "an earlier one), a learning rate too high, or inf/nan in the rewards")
