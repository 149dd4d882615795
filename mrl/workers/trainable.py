"""Checkpoint and offload hooks shared by the workers that own an optimizer (actor, critic)."""
from __future__ import annotations

import os


class TrainableState:
    """Mixin: needs ``self.model`` (MegatronModel), ``self.optimizer``, ``self.scheduler`` and
    ``self.global_step``. Saving goes through ``dist_checkpointing`` so a checkpoint written at
    one TP/PP layout loads at another (mrl/megatron/checkpoint.py)."""

    def optimizer_step(self, metrics: dict[str, float], acc: dict[str, float]) -> None:
        """One optimizer (+ LR scheduler) step; adds its grad norm to ``metrics``, then ``metrics`` into ``acc``."""
        ok, grad_norm, _ = self.optimizer.step()
        if ok:  # Megatron skips the step on inf/nan gradients; the schedule must not advance then
            self.scheduler.step(increment=1)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        for k, v in metrics.items():
            acc[k] = acc.get(k, 0.0) + v

    def save(self, ckpt_dir: str | os.PathLike, *, optimizer: bool = True, extra: bool = True) -> None:
        """Model (+ optimizer and LR scheduler) (+ ``extra``: the update counter); layout independent."""
        from mrl.megatron.checkpoint import save_checkpoint

        save_checkpoint(ckpt_dir, self.model.chunks, self.optimizer if optimizer else None,
                        self.scheduler if optimizer else None,
                        extra={"global_step": self.global_step} if extra else {}, hf_config=self.model.hf_config)

    def load(self, ckpt_dir: str | os.PathLike, *, load_optimizer: bool = True, load_extra: bool = True) -> None:
        from mrl.megatron.checkpoint import load_checkpoint

        extra = load_checkpoint(ckpt_dir, self.model.chunks, self.optimizer, self.scheduler,
                                load_optimizer=load_optimizer)
        if load_extra:
            self.global_step = int((extra or {}).get("global_step", self.global_step))

    def offload(self, *, force: bool = False) -> None:
        """Parameters, grads and optimizer state to CPU (no-op on CPU unless ``force``)."""
        from mrl.workers.offload import offload_state

        self._offloaded = offload_state(self.model, self.optimizer, force=force)

    def onload(self) -> None:
        from mrl.workers.offload import onload_state

        onload_state(getattr(self, "_offloaded", None))
        self._offloaded = None
