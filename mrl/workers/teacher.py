"""The frozen teacher of on-policy distillation (``teacher``; docs/distillation.md): ``teacher_log_prob``
[B, R] = log π_teacher(a_t|s_t) of the student's sampled tokens, at the rollout temperature (the student's
log-probs are of ``softmax(z / T)`` too, so a teacher equal to the student gives exactly 0 reverse KL).

A causal LM of its own (its checkpoint, its shape; not swapped into the actor's chunks as the colocated
reference is), frozen: no DDP, no optimizer. Colocated, it runs in the actor's processes and Megatron
groups (``init_parallel=False``) and may wait in host memory between steps (``teacher.offload``);
separate, in a worker group of its own (:class:`mrl.workers.side_rank.SideModelRank`). Offload and DP padding
are the side-model base's (:class:`mrl.workers.side_model.SideModelWorker`).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from mrl.config.parallel import ParallelConfig
from mrl.dtypes import torch_dtype
from mrl.workers.batch import TrainBatch
from mrl.workers.megatron_model import MegatronModel
from mrl.workers.side_model import SideModelWorker

if TYPE_CHECKING:
    from mrl.config import MRLConfig
    from mrl.config.run_plan import RunPlan


class TeacherWorker(SideModelWorker):
    what = "teacher"

    def __init__(self, model_path: str | os.PathLike, parallel: ParallelConfig, *, micro_batch_size: int,
                 temperature: float, device: str = "cpu", dtype: torch.dtype | None = None, seed: int,
                 init_parallel: bool = True, logits_chunk_size: int | None = None, shared_prefix: bool = False,
                 remove_padding: bool = False) -> None:
        """``shared_prefix``: the run plan's ``actor.shared_prefix`` (each prompt computed once for its n samples,
        as the actor's forwards do); batches padded for DP divisibility use the compact layout. ``remove_padding``:
        the run plan's ``actor.use_remove_padding`` (packed rows, as the actor's forwards)."""
        super().__init__(micro_batch_size)
        self.model = MegatronModel(model_path, parallel, device=device,
                                   dtype=dtype or (torch.float32 if device == "cpu" else torch.bfloat16),
                                   seed=seed, train=False, init_parallel=init_parallel, remove_padding=remove_padding)
        self.temperature = float(temperature)
        self.chunk_size = logits_chunk_size
        self.shared_prefix = shared_prefix

    @classmethod
    def from_config(cls, cfg: MRLConfig, plan: RunPlan, parallel: ParallelConfig, *, device: str,
                    init_parallel: bool) -> TeacherWorker:
        t = cfg.teacher
        return cls(t.path, parallel, micro_batch_size=t.micro_batch_size_per_gpu, temperature=cfg.rollout.temperature,
                   device=device, seed=cfg.trainer.seed, dtype=torch_dtype(plan.dtype), init_parallel=init_parallel,
                   logits_chunk_size=cfg.actor.logits_chunk_size, shared_prefix=plan.shared_prefix,
                   remove_padding=plan.remove_padding)

    def compute(self, batch: TrainBatch) -> torch.Tensor:
        """[B, R] teacher log-probs of the full batch's response tokens, identical on every rank. A batch that
        does not divide by the DP size is padded with copies of its last sample, whose rows are dropped."""
        from mrl.workers.actor import forward_log_probs

        B = batch.batch_size
        batch, extra = self.dp_padded(batch)
        lp = forward_log_probs(
            self.model, batch, temperature=self.temperature, micro_batch_size=self.micro_batch_size,
            use_dynamic_bsz=False, max_tokens=0, vocab_size=int(self.model.hf_config.vocab_size),
            chunk_size=self.chunk_size, shared_prefix=self.shared_prefix and not extra).log_probs
        return lp[:B]
