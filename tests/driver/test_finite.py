"""A non-finite loss or gradient norm stops the run with a message naming it and the step."""
from __future__ import annotations

import math

import pytest

from mrl.driver.finite import NonFiniteError, stop_if_not_finite


def test_nan_loss_stops_the_run() -> None:
    with pytest.raises(NonFiniteError, match=r"step 7: actor/pg_loss=nan.*mrl-ckpt inspect"):
        stop_if_not_finite({"actor/pg_loss": math.nan, "actor/grad_norm": 1.0}, 7, fp16=False)


def test_inf_grad_norm_stops_bf16_but_not_fp16_whose_loss_scale_expects_overflows() -> None:
    m = {"actor/pg_loss": 0.1, "actor/grad_norm": math.inf}
    with pytest.raises(NonFiniteError, match="actor/grad_norm=inf"):
        stop_if_not_finite(m, 1, fp16=False)
    stop_if_not_finite(m, 1, fp16=True)
    stop_if_not_finite({"actor/pg_loss": 0.1, "actor/grad_norm": 0.5, "critic/vf_loss": 2.0}, 1, fp16=False)
