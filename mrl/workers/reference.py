"""Frozen reference policy: ``ref_log_prob`` [B, R] = log π_ref(a_t|s_t), computed once per step.

Two placements (``ref.placement``):

* ``separate`` — :class:`ReferenceWorker`: its own ranks, world and TP/PP/CP layout (``ref.num_devices``,
  ``ref.megatron``), a frozen Megatron model with no DDP and no optimizer, run as the separate teacher is
  (mrl/workers/side_rank.py; the driver reaches it through mrl/driver/side_ranks.py).
* ``colocated`` — :class:`ColocatedReference`: lives inside the actor's processes and reuses
  the actor's model chunks. The reference weights are kept in host memory (pinned on CUDA) and
  copied into the actor's parameters for the forward, then the actor's weights are copied back
  (slime's approach), so no second model copy lives on the device. Copies are exact, so the
  actor's parameters, its DDP buffers and the optimizer's views of them are unchanged afterwards.
  With LoRA on (``actor.lora.rank > 0``) the base weights never change, so the reference is the
  actor's own model with its adapters switched off: no copy, no swap (verl's ``ref_in_actor``).

The result feeds the KL loss (``actor.use_kl_loss``), the KL-in-reward penalty and
``ref_reward_blend`` alike (verl: computed once, reused). ``compute_repr_similarity`` runs the
response-embedding forward under the same swapped-in weights for ``algorithm.repr_align`` (docs/driver.md, "Reward shaping").
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from mrl.config.ref import RefConfig
from mrl.dtypes import torch_dtype
from mrl.workers.batch import TrainBatch
from mrl.workers.megatron_model import MegatronModel
from mrl.workers.side_model import SideModelWorker

if TYPE_CHECKING:
    from mrl.config import MRLConfig
    from mrl.config.parallel import ParallelConfig
    from mrl.config.run_plan import RunPlan


class ReferenceWorker(SideModelWorker):
    """Separate reference on this rank (``placement: separate``): ranks, world and Megatron layout of its own
    (``ref.megatron``), built by :class:`mrl.workers.side_rank.SideModelRank` as the teacher is; frozen
    (``MegatronModel(train=False)``), loaded from ``model.path`` (with LoRA: the base the adapters sit on)."""

    what = "reference"

    def __init__(
        self, cfg: RefConfig, *, model_path: str | os.PathLike, device: str = "cpu",
        temperature: float = 1.0, micro_batch_size: int | None = None, seed: int,
        dtype: torch.dtype | None = None, init_parallel: bool = True,
        logits_chunk_size: int | None = None, moe: Any = None, remove_padding: bool = False,
        shared_prefix: bool = False, use_dynamic_bsz: bool = False, max_tokens: int = 0,
    ) -> None:
        """``moe``: the actor's ``actor.moe`` (same dispatcher and routing replay as the policy);
        ``remove_padding``/``shared_prefix``: the run plan's (packed rows, which context parallelism needs; each
        prompt once for its n samples), as the actor's forwards; ``micro_batch_size``: SAMPLES per forward when
        ``ref.log_prob_micro_batch_size_per_gpu`` is null; ``use_dynamic_bsz``/``max_tokens``: the actor's
        ``use_dynamic_bsz``/``ppo_max_token_len_per_gpu`` (the colocated reference's micro-batches too)."""
        dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
        mbs = cfg.log_prob_micro_batch_size_per_gpu or micro_batch_size
        super().__init__(mbs or 1)
        self.cfg = cfg
        self.micro_batch_size = mbs  # None: the whole DP shard in one forward
        self.temperature = float(temperature)
        self.chunk_size = logits_chunk_size
        self.shared_prefix = shared_prefix
        self.use_dynamic_bsz, self.max_tokens = use_dynamic_bsz, max_tokens
        self.model = MegatronModel(model_path, cfg.megatron, device=device, dtype=dtype, seed=seed,
                                     train=False, init_parallel=init_parallel, moe=moe,
                                     remove_padding=remove_padding)

    @classmethod
    def from_config(cls, cfg: MRLConfig, plan: RunPlan, parallel: ParallelConfig, *, device: str,
                    init_parallel: bool) -> ReferenceWorker:
        """The separate reference of ``cfg`` at ``parallel`` (the layout's: ``ref.megatron``)."""
        a = cfg.actor
        return cls(cfg.ref.model_copy(update={"megatron": parallel}), model_path=cfg.model.path, device=device,
                   temperature=cfg.rollout.temperature,
                   micro_batch_size=a.log_prob_micro_batch_size_per_gpu or a.ppo_micro_batch_size_per_gpu,
                   seed=cfg.trainer.seed, dtype=torch_dtype(plan.dtype), init_parallel=init_parallel,
                   logits_chunk_size=a.logits_chunk_size, moe=a.moe, remove_padding=plan.remove_padding,
                   shared_prefix=plan.shared_prefix, use_dynamic_bsz=a.use_dynamic_bsz,
                   max_tokens=a.ppo_max_token_len_per_gpu)

    def compute(self, batch: TrainBatch) -> torch.Tensor:
        """[B, R] reference log-probs of the full batch, identical on every rank. A batch that does not divide by
        this group's DP size is padded with copies of its last sample, whose rows are dropped."""
        from mrl.workers.actor import forward_log_probs

        B = batch.batch_size
        batch, extra = self.dp_padded(batch)
        lp = forward_log_probs(
            self.model, batch, temperature=self.temperature, micro_batch_size=self.micro_batch_size,
            use_dynamic_bsz=self.use_dynamic_bsz, max_tokens=self.max_tokens,
            vocab_size=int(self.model.hf_config.vocab_size), chunk_size=self.chunk_size,
            shared_prefix=self.shared_prefix and not extra,
        ).log_probs
        return lp[:B]

    compute_ref_log_prob = compute


class ColocatedReference:
    """Reference weights in host memory, swapped into ``actor``'s model for the forward.

    Build it before the first update (it snapshots the actor's current weights) or pass
    ``model_path`` to load the reference from an HF checkpoint instead.
    """

    def __init__(self, actor, *, model_path: str | os.PathLike | None = None) -> None:
        self.actor = actor
        e = actor.model
        self.host = None
        if getattr(e, "lora", None) and model_path is None:
            return  # the frozen base is the reference: see _swapped_in
        params = self._params()
        if model_path is not None:
            backup = [p.detach().to("cpu", copy=True) for p in params]
            e.load_hf(model_path)
        pin = e.device.type == "cuda"
        self.host = [p.detach().to("cpu", copy=True) for p in params]
        if pin:
            self.host = [h.pin_memory() for h in self.host]
        if model_path is not None:
            with torch.no_grad():
                for p, b in zip(params, backup):
                    p.copy_(b)

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for c in self.actor.model.chunks for p in c.parameters()]

    @contextlib.contextmanager
    def _swapped_in(self) -> Iterator[None]:
        """The reference weights in the actor's parameters inside the block; the actor's are restored after."""
        if self.host is None:
            from mrl.megatron.lora import adapters_disabled

            with adapters_disabled(self.actor.model.chunks):
                yield
            return
        params = self._params()
        with torch.no_grad():
            actor_w = [p.detach().to("cpu", copy=True) for p in params]
            try:
                for p, h in zip(params, self.host):
                    p.copy_(h, non_blocking=True)
                yield
            finally:
                for p, a in zip(params, actor_w):
                    p.copy_(a, non_blocking=True)

    def compute_ref_log_prob(self, batch: TrainBatch) -> torch.Tensor:
        """[B, R] log-probs under the reference weights; the actor's weights are restored after. An MoE
        model replays the engine's experts here too (routing replay) without counting in the policy's moe/*."""
        from mrl.workers.routing_replay import not_measured

        with self._swapped_in(), not_measured(self.actor.model.router_probes):
            lp, _ = self.actor.compute_log_prob(batch, record_routing=False)  # not the old policy's routing (R2)
        return lp

    def compute_repr_similarity(self, batch: TrainBatch, gold: TrainBatch) -> torch.Tensor:
        """[B] ``cos(e(batch)_i, e(gold)_i)`` of reference response embeddings (``algorithm.repr_align``).

        ``e`` is :func:`mrl.workers.embedding.response_embedding` (mean final-norm hidden state over
        the response tokens) under the reference weights, i.e. the initial policy (docs/driver.md, "Reward shaping": the
        same HF model); ``gold`` holds the same prompts with the gold answer as the response.
        Cosine in float64 (eps 1e-12), so identical sequences give 1 up to the forward's round-off.
        """
        if gold.batch_size != batch.batch_size:
            raise ValueError(f"compute_repr_similarity: {gold.batch_size} gold samples for {batch.batch_size}")
        with self._swapped_in():
            e_gen = self.actor.compute_response_embedding(batch)
            e_gold = self.actor.compute_response_embedding(gold)
        return torch.nn.functional.cosine_similarity(e_gen.double(), e_gold.double(), dim=-1, eps=1e-12).float()
