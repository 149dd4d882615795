"""Megatron optimizer (Adam, optionally the DistributedOptimizer) and LR schedule of a trained role.

Both are Megatron-Core components: ``get_megatron_optimizer`` (fp32 master weights for bf16
models, gradient clipping by global norm over all model-parallel ranks, ZeRO-1 sharding of the
Adam state over DP when ``use_distributed_optimizer``) and ``OptimizerParamScheduler``
(checkpointable). Schedule, with t the number of optimizer steps taken, W warmup steps and
T = total optimizer steps:

    lr(t) = lr · t / W                                          t <= W   (linear warmup from 0)
    lr(t) = lr                                                   constant
    lr(t) = min_lr + (lr − min_lr) · (1 − (t−W)/(T−W))           linear
    lr(t) = min_lr + (lr − min_lr) · ½(1 + cos(π (t−W)/(T−W)))   cosine,   min_lr = min_lr_ratio · lr

verl steps its scheduler once per trainer step; Megatron once per optimizer step. We follow
Megatron (one ``scheduler.step(1)`` per optimizer step), so ``total_optimizer_steps`` =
``total_training_steps × mini-batches per step × ppo_epochs`` (the caller computes it).
"""
from __future__ import annotations

from typing import Any

import torch

from mrl.config.optim import OptimConfig


def build_optimizer(
    model_chunks: list[torch.nn.Module],
    optim: OptimConfig,
    *,
    use_distributed_optimizer: bool,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """Megatron Adam(W) over ``model_chunks`` (DDP-wrapped) with ``optim``'s hyper-parameters."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.lr * optim.min_lr_ratio,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        clip_grad=optim.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    opt = get_megatron_optimizer(cfg, list(model_chunks))
    for inner in getattr(opt, "chained_optimizers", [opt]):
        torch_opt = getattr(inner, "optimizer", None)
        for group in getattr(torch_opt, "param_groups", []):
            # torch runs Adam tensor by tensor on CPU unless told otherwise; its fused CPU kernel does the
            # update in one vectorised pass per tensor, faster than the loop and than multi-tensor "foreach"
            # (the previous choice; docs/performance.md, 'Fused Adam on CPU'), and
            # the weights agree with the loop to float rounding (the fused kernel orders the same
            # arithmetic differently; run to run it is bitwise reproducible).
            if (group.get("fused") is None and not group.get("foreach")
                    and all(p.device.type == "cpu" for p in group["params"])):
                group["fused"], group["foreach"] = True, False
    return opt


def build_lr_scheduler(optimizer: Any, optim: OptimConfig, *, total_optimizer_steps: int | None) -> Any:
    """``OptimizerParamScheduler`` for :class:`OptimConfig` (see module docstring).

    ``total_optimizer_steps=None`` is only valid with the constant schedule and no warmup ratio.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if total_optimizer_steps is None:
        if optim.lr_schedule != "constant" or (optim.lr_warmup_steps == 0 and optim.lr_warmup_steps_ratio > 0):
            raise ValueError(
                f"optim.lr_schedule={optim.lr_schedule!r} / lr_warmup_steps_ratio need the run length: "
                "the run plan derives it from trainer.total_training_steps or total_epochs x the training rows"
            )
        total = max(optim.lr_warmup_steps, 1) + 1
    else:
        total = max(int(total_optimizer_steps), 1)
    warmup = optim.lr_warmup_steps or int(optim.lr_warmup_steps_ratio * total)
    warmup = min(warmup, total - 1)
    total = max(total, warmup + 1)  # Megatron asserts warmup < decay steps
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.lr * optim.min_lr_ratio,
        lr_warmup_steps=warmup,
        lr_decay_steps=total,
        lr_decay_style=optim.lr_schedule,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=total,
        wd_incr_style="constant",
        # On resume the schedule follows THIS run's config (a longer trainer.total_training_steps
        # re-stretches the decay from the restored step) instead of the checkpoint's old length,
        # which would leave the LR stuck at its minimum; only the step counter is restored.
        override_opt_param_scheduler=True,
        use_checkpoint_opt_param_scheduler=False,
    )


def current_lr(optimizer: Any) -> float:
    """LR of the first param group (what ``actor/lr`` reports)."""
    return float(optimizer.param_groups[0]["lr"])
