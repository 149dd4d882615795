"""Mixture-of-Experts settings of the actor (``actor.moe``); the reference and critic follow them.

The model's own routing (experts, top-k, normalisation, shared expert, aux-loss coefficient) comes
from its config.json (:mod:`mrl.megatron.moe`); this section holds what the trainer decides.
Dense models ignore nothing here silently: validation refuses non-default values for them.

Routing replay (``routing_replay``), docs/moe.md:

* ``none``    every forward routes on its own (old-log-prob, reference and update forwards may
  pick other experts than the engine did for the same token).
* ``rollout`` (R3) the experts the inference engine chose for every token of a sample are replayed
  in the trainer's forwards: ``probs`` are recomputed from the trainer's router logits, only the
  *choice* is the engine's, so gradients still reach the router through the chosen experts.
  Needs the engine to return them (SGLang ``--enable-return-routed-experts``; the embedded engine
  always can).
* ``old``     (R2, verl's ``router_replay.mode: R2``, slime's ``--use-routing-replay``) the actor's
  old-log-prob forward records the experts it chose for every token and the update's forwards replay
  them: every mini-batch and epoch routes as the policy that computed log π_old did, however far the
  weights have moved since. Needs that forward (not the on-policy shortcut); the reference and critic
  route on their own; nothing is asked of the engines.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from mrl.config.base import Section

# Above 1 the load-balancing term outweighs the policy loss (see MoEConfig._bounded_aux_loss).
AUX_LOSS_COEF_MAX = 1.0


class MoEConfig(Section):
    """Trainer-side MoE knobs (verl ``actor.megatron`` / slime MoE flags)."""

    routing_replay: Literal["none", "rollout", "old"] = Field(
        "none", description="none | rollout (R3: replay the engine's expert choice of every token in the trainer's "
        "old-log-prob, reference and update forwards) | old (R2: record the old-log-prob forward's expert choice and "
        "replay it in the update's forwards); docs/moe.md.",
    )
    token_dispatcher: Literal["alltoall", "allgather"] = Field(
        "alltoall", description="Megatron token dispatcher for expert parallelism: alltoall (Megatron-LM's default "
        "for EP > 1) or allgather.",
    )
    @property
    def engine_routed_experts(self) -> bool:
        """The engines must return each token's routed experts (SGLang ``--enable-return-routed-experts``)."""
        return self.routing_replay == "rollout"

    aux_loss_coef: float | None = Field(
        None, ge=0, description="Load-balancing (Switch) loss weight added to the actor loss, at most "
        f"{AUX_LOSS_COEF_MAX:g}; null = the model's config.json router_aux_loss_coef. Reported as moe/aux_loss.",
    )

    @field_validator("aux_loss_coef")
    @classmethod
    def _bounded_aux_loss(cls, v: float | None) -> float | None:
        if v is not None and v > AUX_LOSS_COEF_MAX:
            raise ValueError(
                f"{v:g} is beyond {AUX_LOSS_COEF_MAX:g}: the Switch load-balancing loss of an MoE layer, "
                "E * sum_i f_i * P_i, is 1 at perfect balance and more when unbalanced, so a weight above 1 outweighs the policy loss (order 1) and "
                "a huge one overflows the float32 loss to inf (NaN gradients at step 1); fix: a weight such as 0.001-0.01 "
                "(the models' own router_aux_loss_coef), or null")
        return v
