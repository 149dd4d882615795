"""The config base of a side model: a model beside the policy that computes something about its samples.

Three sections derive from it — ``reward_model`` (a sequence classifier: a score per sample),
``teacher`` (a causal LM: log-probs of the sampled tokens, distillation) and ``reward.judge`` (a causal
LM served by engines: a written verdict per sample). What they share is declared once here:

* :class:`SideModelConfig` — ``enable``, and where its weights and tokenizer are
  (:meth:`~SideModelConfig.model_dir`, :meth:`~SideModelConfig.tokenizer_dir`; each section keeps its
  own YAML key for them: ``reward_model.model.path``, ``teacher.path``, ``reward.judge.model``).
* :class:`RankSideModelConfig` — a side model that runs as Megatron ranks: ``placement`` (colocated on
  the actor's ranks, or ``separate`` on ``num_devices`` of its own with the ``megatron`` layout),
  ``offload`` and ``micro_batch_size_per_gpu``; :meth:`~RankSideModelConfig.parallel` is its layout.

A new model-judged signal is one section deriving from one of these plus one scorer
(``mrl/driver/scoring.py``); ARCHITECTURE.md, "Side models".
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from mrl.config.base import Section
from mrl.config.parallel import ParallelConfig


class SideModelConfig(Section):
    """A side model: on or off, and where its checkpoint and tokenizer are (module doc)."""

    enable: bool = Field(False, description="Build this side model and run its phase.")

    def model_dir(self) -> str | None:
        """The checkpoint directory of its weights (None: not set, or not a local model)."""
        raise NotImplementedError

    def tokenizer_dir(self) -> str | None:
        """The directory of the tokenizer it reads its inputs with (by default its checkpoint's)."""
        return self.model_dir()


class RankSideModelConfig(SideModelConfig):
    """A side model on Megatron ranks: the actor's (colocated) or a group of its own (separate)."""

    score_head: ClassVar[bool] = False  # a [1, H] score head in place of the LM head (a sequence classifier)

    placement: Literal["colocated", "separate"] = Field(
        "colocated", description="colocated: on the actor's ranks with actor.megatron's layout and groups (devices "
        "shared phase by phase); separate: on num_devices devices of its own after the actor's (verl's resource pool "
        "of the role): its own Ray worker group, torch.distributed world and Megatron layout (megatron).")
    num_devices: int | None = Field(None, ge=1, description="Devices of this model with placement=separate (taken "
                                    "from cluster.nnodes*n_gpus_per_node, the actor gets the rest); required with "
                                    "placement=separate, refused with colocated.")
    megatron: ParallelConfig | None = Field(
        None, description="Megatron layout with placement=separate (DP = num_devices / (TP*PP)); null = "
        "actor.megatron's sizes (once set, its unset keys take the defaults below, not the actor's). Colocated, the "
        "model runs in the actor's groups: null or equal to actor.megatron.")
    offload: bool = Field(False, description="Colocated only: keep this model's weights in host memory outside its "
                          "phase (moved to the device for its forward; a no-op on CPU).")
    micro_batch_size_per_gpu: int = Field(8, ge=1, description="SAMPLES per forward of this model on one DP rank.")

    @property
    def colocated(self) -> bool:
        return self.placement == "colocated"

    def parallel(self, actor: ParallelConfig) -> ParallelConfig:
        """Its Megatron layout: colocated, the actor's groups (``actor``); separate, ``megatron`` (null: the
        actor's sizes)."""
        if self.placement == "separate" and self.megatron is not None:
            return self.megatron
        return actor
