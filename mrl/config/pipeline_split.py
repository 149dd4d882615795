"""How Megatron splits the decoder layers over pipeline stages, computed before Megatron starts.

Even split: every stage (and each of its VPP chunks) gets ``L / (PP * VPP)`` layers. Uneven split
(Megatron's ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``, what verl's and
slime's DeepSeek-V3 recipes set for its 61 layers): the first and/or last stage get the given counts and the
``M = L - first - last`` layers left are split evenly over the ``PP - (#given)`` middle stages::

    stage 0: first (or M / middle),  stages 1..PP-2: M / middle,  stage PP-1: last (or M / middle)

With VPP each stage's count must also divide by VPP (its chunks are equal). The rules are Megatron-Core
0.16's (``TransformerConfig.__post_init__``, ``get_transformer_layer_offset``); tests compare this module with
what Megatron builds, so a plan that passes here does not fail inside Megatron.
"""
from __future__ import annotations

import math


class SplitError(ValueError):
    """The layers cannot be split so; the message says why (the caller adds the key and the fix)."""


def stage_layer_counts(num_layers: int, pp: int, vpp: int | None = None, first: int | None = None,
                       last: int | None = None) -> list[int]:
    """Layers per pipeline stage (all VPP chunks of a stage together), or :class:`SplitError`."""
    v = vpp or 1
    if first is None and last is None:
        if num_layers % (pp * v):
            raise SplitError(f"{num_layers} layers do not split evenly over PP*VPP = {pp * v} stages")
        return [num_layers // pp] * pp
    if pp == 1:
        raise SplitError("an uneven split needs pipeline_model_parallel_size > 1")
    given = {k: n for k, n in (("first", first), ("last", last)) if n is not None}
    for k, n in given.items():
        if n % v:
            raise SplitError(f"the {k} stage's {n} layers do not divide by VPP = {v}")
    middle_stages = pp - len(given)
    middle = num_layers - sum(given.values())
    if middle < 0 or bool(middle) != bool(middle_stages):
        raise SplitError(f"{num_layers} layers leave {middle} for {middle_stages} middle stage(s) after "
                         f"{' and '.join(f'{n} in the {k} stage' for k, n in given.items())}")
    if middle_stages and middle % (middle_stages * v):
        raise SplitError(f"the {middle} layers left for the {middle_stages} middle stage(s) do not split evenly"
                         + (f" into {v} VPP chunks each" if v > 1 else ""))
    per = middle // middle_stages if middle_stages else 0
    counts = [per] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def suggest_split(num_layers: int, pp: int) -> dict[str, int] | None:
    """An uneven split (no VPP) for ``num_layers`` over ``pp`` stages: the other stages get ``ceil(L / PP)``
    each and the last stage the rest, or (when that leaves the last stage nothing) ``floor(L / PP)`` each and
    the first stage the rest; None when PP divides L or neither works."""
    if pp < 2 or num_layers % pp == 0:
        return None
    up, down = math.ceil(num_layers / pp), num_layers // pp
    if num_layers - (pp - 1) * up > 0:
        return {"num_layers_in_last_pipeline_stage": num_layers - (pp - 1) * up}
    if down > 0:
        return {"num_layers_in_first_pipeline_stage": num_layers - (pp - 1) * down}
    return None
