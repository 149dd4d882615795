"""Per-rank value model for GAE-based PPO: Megatron GPTModel with a scalar head.

``V(s_t)`` for response token a_t is read at the position of the token before it (the state
the policy acted in), like verl's critic. Loss (verl's ray_trainer step; docs/driver.md, verl ``compute_value_loss``):

    L_V = ½ · agg(max((V − R)², (clip(V, V_old − ε, V_old + ε) − R)²))      ε = cliprange_value

normalised like the actor loss (global denominators per mini-batch, × n_mb · D; see
:mod:`mrl.workers.loss`). The head ``w ∈ R^H`` is initialised randomly (N(0, 1/H)) on top of the
HF body (``critic.model_path`` or the actor's checkpoint).
"""
from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch

from mrl.config.critic import CriticConfig
from mrl.workers.actor import micro_batch_parts
from mrl.workers.batch import TrainBatch
from mrl.workers.loss import (
    check_norm_constant,
    critic_loss_func,
    global_denominators,
    response_values,
    sum_metrics,
)
from mrl.workers.megatron_model import MegatronModel
from mrl.workers.minibatch import make_minibatch_iterator, restore_order
from mrl.workers.optim import build_lr_scheduler, build_optimizer, current_lr
from mrl.workers.trainable import TrainableState


class CriticWorker(TrainableState):
    """The critic on this rank.

    Args:
        cfg: the ``critic`` section; ``ppo_mini_batch_size``/``ppo_epochs`` already resolved
            by the caller (``mini_batch_size_samples``, ``epochs``).
        mini_batch_size_samples: samples per optimizer step, global over DP.
        max_response_length: ``rollout.max_response_length``, Dr.GRPO's fixed ``C`` of
            ``critic.loss_agg_mode=seq-mean-token-sum-norm`` (required there, unused otherwise).
        remove_padding: ``actor.use_remove_padding`` as the run plan resolved it (packed micro-batches).
    """

    def __init__(
        self, cfg: CriticConfig, *, model_path: str | os.PathLike, device: str = "cpu",
        mini_batch_size_samples: int, epochs: int = 1, total_optimizer_steps: int | None = None,
        seed: int, dtype: torch.dtype | None = None, init_parallel: bool = True,
        max_response_length: int | None = None, moe: Any = None, remove_padding: bool = False,
    ) -> None:
        check_norm_constant(cfg.loss_agg_mode, max_response_length, "critic")
        self.norm_constant = max_response_length
        dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
        self.cfg = cfg
        self.epochs = epochs
        self.seed = seed
        self.model = MegatronModel(cfg.model_path or model_path, cfg.megatron, device=device, dtype=dtype,
                                     seed=seed, train=True, value_head=True, init_parallel=init_parallel,
                                     use_distributed_optimizer=cfg.use_distributed_optimizer, moe=moe,
                                     remove_padding=remove_padding, recompute=cfg.recompute_granularity)
        if mini_batch_size_samples % self.model.dp_size:
            raise ValueError(
                f"critic mini-batch of {mini_batch_size_samples} samples is not divisible by its DP "
                f"size {self.model.dp_size}; adjust critic.ppo_mini_batch_size"
            )
        self.mini_batch_size_samples = mini_batch_size_samples
        self.optimizer = build_optimizer(self.model.chunks, cfg.optim,
                                         use_distributed_optimizer=cfg.use_distributed_optimizer, dtype=dtype)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.optim, total_optimizer_steps=total_optimizer_steps)
        self.global_step = 0

    def _parts(self, data: TrainBatch):
        return micro_batch_parts(data, micro_batch_size=self.cfg.ppo_micro_batch_size_per_gpu or data.batch_size,
                                 use_dynamic_bsz=self.cfg.use_dynamic_bsz,
                                 max_tokens=self.cfg.ppo_max_token_len_per_gpu * self.model.cp_size,
                                 dp_group=self.model.dp_group,
                                 min_parts=self.model.min_micro_batches)  # per device: a CP rank holds 1/CP of each row

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """[B, R] V(s_t) × response_mask of the full batch, identical on every rank."""
        e = self.model
        local = e.dp_shard(batch)
        parts = self._parts(local)
        mbs = e.make_micro_batches(local, parts)

        def fn(mb, out):
            return torch.zeros((), device=out.device), {"v": response_values(mb, out.detach())}

        e.set_train(False)
        with torch.no_grad():
            out = e.run(mbs, fn, forward_only=True)
        if e.is_last_stage:
            v = restore_order([o["v"] for o in out], parts).to(e.device)
        else:
            v = torch.zeros(local.batch_size, local.response_length, device=e.device)
        v = e.all_gather_dp(e.broadcast_from_last_stage(v)).cpu()
        return v * batch.response_mask.to(v.dtype)

    def update_critic(self, batch: TrainBatch) -> dict[str, float]:
        """Value regression on ``returns`` with clipping around ``values``; verl's metric names."""
        e = self.model
        local = e.dp_shard(batch)
        acc: dict[str, float] = {}
        steps = 0
        for mb in make_minibatch_iterator(local, mini_batch_size=self.mini_batch_size_samples // e.dp_size,
                                          epochs=self.epochs, seed=self.seed + self.global_step,
                                          select_keys=["values", "returns"]):
            parts = self._parts(mb)
            mbs = e.make_micro_batches(mb, parts)
            n_tok, n_seq = global_denominators(mbs, e)
            fn = partial(critic_loss_func, cliprange_value=self.cfg.cliprange_value,
                         loss_agg_mode=self.cfg.loss_agg_mode, n_tok=n_tok, n_seq=n_seq,
                         scale=float(len(mbs) * e.dp_size), norm_constant=self.norm_constant)
            for c in e.chunks:
                c.zero_grad_buffer()
            self.optimizer.zero_grad()
            e.set_train(True)
            m = sum_metrics(e.run(mbs, fn, forward_only=False), ["vf_loss", "vf_clipfrac", "vpred_mean"], e)
            self.optimizer_step(m, acc)
            steps += 1
        self.global_step += 1
        out = {f"critic/{k}": v / steps for k, v in acc.items()}
        out["critic/lr"] = current_lr(self.optimizer)
        return out

