"""Mixtral (``MixtralForCausalLM``): Mistral's decoder with every MLP an MoE layer.

Router: softmax → top-k → renormalised, always; one expert's width is ``intermediate_size``; the
checkpoint names the block ``block_sparse_moe`` and an expert's projections ``w1`` (gate), ``w3`` (up),
``w2`` (down). A set ``sliding_window`` windows every layer (as Mistral). Refuses
``router_jitter_noise != 0`` (random router noise: the trainer's routing would differ from the engine's).
"""
from __future__ import annotations

from typing import Any

from mrl.families.base import Family, MoE
from mrl.families.rules import ATTENTION, MODEL_RULES, moe_rules

_EXPERTS = ("w1", "w3", "w2")


def _refuse(hf_config: Any) -> None:
    if float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0) != 0.0:
        raise ValueError(
            "config.json router_jitter_noise != 0: random router noise makes the trainer's routing differ "
            "from the engine's; set it to 0.0"
        )


FAMILY = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    weight_rules=MODEL_RULES + ATTENTION + moe_rules("block_sparse_moe", *_EXPERTS),
    sliding_window=True,
    moe=MoE(block="block_sparse_moe", expert_names=_EXPERTS, expert_ffn_size=lambda c: int(c.intermediate_size),
            norm_topk=lambda _c: True, refuse=_refuse),
    engine_refuses_sliding_window=True,
)
