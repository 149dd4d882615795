"""Per-rank policy worker: Megatron GPTModel + DDP + (Distributed)Optimizer, verl's actor API.

``compute_log_prob`` and ``update_policy`` take the **full** step batch on every rank (the
driver has DP-balanced it with :func:`mrl.data.balance.balanced_dp_permutation`); each DP rank
works on its contiguous slice and results come back identical on every rank, in the caller's
sample order. Units: see :mod:`mrl.workers.batch`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from functools import partial
from typing import NamedTuple

import torch

from mrl.config.actor import ActorConfig
from mrl.config.algorithm import DistillConfig
from mrl.observability import names as N
from mrl.workers.batch import TrainBatch
from mrl.workers.loss import (
    ActorLossSpec,
    actor_loss_func,
    check_norm_constant,
    global_denominators,
    log_prob_func,
    sum_metrics,
)
from mrl.workers.megatron_model import MegatronModel
from mrl.workers.minibatch import (
    at_least,
    loss_keys,
    make_minibatch_iterator,
    restore_order,
    split_by_length,
    split_by_prompt,
    split_dynamic,
)
from mrl.workers.optim import build_lr_scheduler, build_optimizer, current_lr
from mrl.workers.trainable import TrainableState

_METRIC_KEYS = ["loss", "pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy", "kl_loss", "distill_loss"]


def micro_batch_parts(data: TrainBatch, *, micro_batch_size: int | None, use_dynamic_bsz: bool,
                      max_tokens: int, dp_group, shared_prefix: bool = False, min_parts: int = 1) -> list[list[int]]:
    """Fixed split by samples (sorted by length; with ``shared_prefix`` a prompt's samples kept
    together), or balanced token-budget split (same count on all DP ranks); at least ``min_parts`` micro-batches
    where the samples allow (``MegatronModel.min_micro_batches``)."""
    if use_dynamic_bsz:
        return split_dynamic(data.seq_lengths().tolist(), max_tokens, dp_group=dp_group, min_parts=min_parts)
    if micro_batch_size is None:
        raise ValueError(
            "actor.ppo_micro_batch_size_per_gpu is null and use_dynamic_bsz is false: set one of them"
        )
    if shared_prefix:
        return at_least(split_by_prompt(data, micro_batch_size), min_parts)
    return at_least(split_by_length(data.seq_lengths().tolist(), micro_batch_size), min_parts)


class ActorWorker(TrainableState):
    """The policy on this rank.

    Args:
        cfg: the ``actor`` config section.
        model_path: HF checkpoint to start from.
        device: ``cpu`` | ``cuda``.
        mini_batch_size_samples: samples per optimizer step, global over DP
            (``ppo_mini_batch_size × rollout.n``).
        temperature: the rollout sampling temperature (log-probs are of ``softmax(z / T)``).
        max_response_length: ``rollout.max_response_length``, Dr.GRPO's fixed ``C`` of
            ``loss_agg_mode=seq-mean-token-sum-norm`` (required there, unused otherwise).
        total_optimizer_steps: LR-schedule length in optimizer steps (None: constant schedule).
        dtype: parameter dtype; default fp32 on CPU, bf16 on CUDA.
        shared_prefix: ``actor.shared_prefix`` as the run plan resolved it (``auto`` decided there); None:
            ``cfg.shared_prefix`` when it is a boolean, off for ``auto`` (a worker built without a plan).
        init_parallel: initialise torch.distributed/Megatron groups for ``cfg.megatron``.
        remove_padding: ``actor.use_remove_padding`` as the run plan resolved it; None: ``cfg``'s when a boolean,
            off for ``auto`` (a worker built without a plan).
        attention_backend: ``actor.megatron.attention_backend`` as the run plan resolved it (None: resolved here).
        distill: ``algorithm.distill``; with mode=kl_loss the loss gets its teacher-KL term.
    """

    def __init__(
        self,
        cfg: ActorConfig,
        *,
        model_path: str | os.PathLike,
        device: str = "cpu",
        mini_batch_size_samples: int,
        temperature: float = 1.0,
        max_response_length: int | None = None,
        total_optimizer_steps: int | None = None,
        seed: int,
        dtype: torch.dtype | None = None,
        init_parallel: bool = True,
        shared_prefix: bool | None = None,
        distill: DistillConfig | None = None,
        remove_padding: bool | None = None,
        attention_backend: str | None = None,
    ) -> None:
        check_norm_constant(cfg.loss_agg_mode, max_response_length, "actor")
        self.cfg = cfg
        self.shared_prefix = cfg.shared_prefix is True if shared_prefix is None else shared_prefix
        self.temperature = float(temperature)
        self.seed = seed
        dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
        self.model = MegatronModel(
            model_path, cfg.megatron, device=device, dtype=dtype, seed=seed, train=True,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
            init_parallel=init_parallel, lora=cfg.lora, moe=cfg.moe,
            remove_padding=cfg.use_remove_padding is True if remove_padding is None else remove_padding,
            attention_backend=attention_backend, recompute=cfg.recompute_granularity,
            freeze_vision_tower=cfg.freeze_vision_tower,
        )
        e = self.model
        if mini_batch_size_samples % e.dp_size != 0:
            raise ValueError(
                f"mini-batch of {mini_batch_size_samples} samples (actor.ppo_mini_batch_size × "
                f"rollout.n) is not divisible by the actor's DP size {e.dp_size}"
            )
        self.mini_batch_size_samples = mini_batch_size_samples
        self.optimizer = build_optimizer(
            e.chunks, cfg.optim, use_distributed_optimizer=cfg.use_distributed_optimizer, dtype=dtype,
        )
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.optim, total_optimizer_steps=total_optimizer_steps)
        self.loss_spec = ActorLossSpec.from_config(cfg, self.temperature, max_response_length=max_response_length,
                                                   distill=distill)
        self.vocab_size = int(e.hf_config.vocab_size)
        self.global_step = 0
        self._update_micro_batches = 0  # since the last update's metrics: moe/aux_loss's denominator
        # actor.moe.routing_replay=old (R2): the old-log-prob forward's routing, replayed by the next update
        self.old_routing: OldRouting | None = None

    @property
    def records_routing(self) -> bool:
        """R2: compute_log_prob records the routing that update_policy replays."""
        return self.cfg.moe.routing_replay == "old" and bool(self.model.router_probes)

    # ---- forward only ------------------------------------------------------------------
    def compute_log_prob(self, batch: TrainBatch, *, temperature: float | None = None, record_routing: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(old_log_probs [B, R], entropys [B, R]) of the full batch, identical on every rank.

        With ``actor.moe.routing_replay=old`` (R2) this is the old policy's forward: its routing is kept
        (:attr:`old_routing`, ``[B, S, layers, K]`` on every rank) for the next ``update_policy`` of the same batch
        to replay. ``record_routing=False``: a forward that is not the old policy's (the colocated reference)."""
        mbs = self.cfg.log_prob_micro_batch_size_per_gpu or self.cfg.ppo_micro_batch_size_per_gpu
        record = record_routing and self.records_routing
        out = forward_log_probs(
            self.model, batch, temperature=self.temperature if temperature is None else temperature,
            micro_batch_size=mbs, use_dynamic_bsz=self.cfg.use_dynamic_bsz,
            max_tokens=self.cfg.ppo_max_token_len_per_gpu, vocab_size=self.vocab_size,
            chunk_size=self.cfg.logits_chunk_size, shared_prefix=self.shared_prefix, record_routing=record,
        )
        if record:
            self.old_routing = OldRouting(batch.input_ids.clone(), out.routing)
        return out.log_probs, out.entropys

    def with_old_routing(self, batch: TrainBatch) -> TrainBatch:
        """R2: ``batch`` carrying the routing its old-log-prob forward recorded, which every forward of the update
        then replays (the engine's ids of R3 have the same layout). Other modes: ``batch`` as it is."""
        if not self.records_routing:
            return batch
        rec = self.old_routing
        if rec is None or rec.input_ids.shape != batch.input_ids.shape or not torch.equal(rec.input_ids,
                                                                                          batch.input_ids):
            raise RuntimeError(
                "actor.moe.routing_replay=old: the update's batch has no recorded routing; the old-log-prob forward "
                "(compute_log_prob of this same batch) records it and must run first (actor.on_policy_shortcut "
                "skips that forward: set it to false)")
        self.old_routing = None  # one update per recording
        return batch.replace(routed_experts=rec.routing)

    # ---- update ------------------------------------------------------------------------
    def forward_backward(self, mini_batch: TrainBatch) -> dict[str, float]:
        """Accumulate ∇L(M) of one (local) mini-batch in the DDP grad buffers; no optimizer step.

        One ``get_forward_backward_func()`` call over its micro-batches; returns the mini-batch
        loss terms summed over micro-batches and DP ranks (identical on every rank).
        """
        return self._forward_backward(mini_batch, self.loss_spec)[0]

    def _forward_backward(self, mini_batch: TrainBatch, spec: ActorLossSpec
                          ) -> tuple[dict[str, float], list[dict], list[list[int]]]:
        """forward_backward's work; also the micro-batches' raw outputs (last stage) and their split."""
        e = self.model
        parts = micro_batch_parts(
            mini_batch, micro_batch_size=self.cfg.ppo_micro_batch_size_per_gpu,
            use_dynamic_bsz=self.cfg.use_dynamic_bsz, max_tokens=self.cfg.ppo_max_token_len_per_gpu * e.cp_size,
            dp_group=e.dp_group, shared_prefix=self.shared_prefix, min_parts=e.min_micro_batches,
        )
        mbs = e.make_micro_batches(mini_batch, parts, shared_prefix=self.shared_prefix)
        n_tok, n_seq = global_denominators(mbs, e)
        loss = partial(
            actor_loss_func, spec=spec, n_tok=n_tok, n_seq=n_seq,
            scale=float(len(mbs) * e.dp_size), tp_group=e.tp_group, vocab_size=self.vocab_size,
            chunk_size=self.cfg.logits_chunk_size,
        )
        for c in e.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        e.set_train(True)
        out = e.run(mbs, loss, forward_only=False)
        self._update_micro_batches += len(mbs)
        return sum_metrics(out, _METRIC_KEYS, e), out, parts

    def update_policy(self, batch: TrainBatch) -> dict[str, float]:
        """PPO/GRPO update on the full step batch: ``ppo_epochs`` × mini-batches optimizer steps.

        Returns verl's metric names, averaged over the optimizer steps of this call:
        ``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``, ``actor/ppo_kl``,
        ``actor/entropy``, ``actor/kl_loss``, ``actor/kl_coef``, ``actor/grad_norm``, ``actor/lr``; and
        ``perf/pad_fraction``: padded positions / positions the update's forwards computed (0 when packed rows
        need no alignment padding).
        """
        e = self.model
        local = e.dp_shard(self.with_old_routing(batch))
        keys = loss_keys(use_kl_loss=self.cfg.use_kl_loss,
                         use_rollout_log_probs=self.cfg.tis_imp_ratio_cap is not None,
                         use_rollout_is_weights=batch.rollout_is_weights is not None,
                         use_teacher_kl=bool(self.loss_spec.distill_coef))
        acc: dict[str, float] = {}
        steps = 0
        e.positions.zero_()  # perf/pad_fraction counts the update's forwards only
        for mb in make_minibatch_iterator(
            local, mini_batch_size=self.mini_batch_size_samples // e.dp_size, epochs=self.cfg.ppo_epochs,
            shuffle=self.cfg.shuffle, seed=self.seed + self.global_step, select_keys=keys,
        ):
            self.optimizer_step(self.forward_backward(mb), acc)
            steps += 1
        return self._finish_update(acc, steps)

    def update_policy_on_policy(self, batch: TrainBatch) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        """``update_policy`` when the update is on-policy (actor.on_policy_shortcut; the run plan checks
        it): one optimizer step on the whole batch, with log π_old = sg(log π_θ) of this very forward —
        π_old *is* π_θ before the first step — so no separate ``compute_log_prob`` pass is needed.
        The ratio is ``exp(log π_θ − sg(log π_θ))``: value 1, gradient ∇log π_θ, the same loss and
        gradient as with the recomputed log π_old (tests/workers/test_on_policy_shortcut.py).

        Returns (metrics, log π_θ [B, R], entropy [B, R]): the detached log-probs/entropies of the
        full batch as ``compute_log_prob`` would give them (the driver's old_log_probs / entropys).
        ``shuffle`` is moot: one mini-batch holds every local sample."""
        e = self.model
        if self.records_routing:
            raise ValueError("the on-policy shortcut runs no old-log-prob forward, which actor.moe.routing_replay=old "
                             "records the routing in; fix: actor.on_policy_shortcut=false")
        local = e.dp_shard(batch)
        if self.cfg.ppo_epochs != 1 or local.batch_size * e.dp_size != self.mini_batch_size_samples:
            raise ValueError(
                f"the on-policy shortcut needs one optimizer step per batch, got actor.ppo_epochs={self.cfg.ppo_epochs} "
                f"and {batch.batch_size} samples for mini-batches of {self.mini_batch_size_samples}; fix: "
                "actor.on_policy_shortcut=null")
        keys = loss_keys(use_kl_loss=self.cfg.use_kl_loss, use_rollout_log_probs=self.cfg.tis_imp_ratio_cap is not None,
                         use_teacher_kl=bool(self.loss_spec.distill_coef))
        spec = dataclasses.replace(self.loss_spec, on_policy=True)
        e.positions.zero_()  # perf/pad_fraction counts the update's forwards only
        metrics, out, parts = self._forward_backward(local.select([k for k in keys if k != "old_log_probs"]), spec)
        acc: dict[str, float] = {}
        self.optimizer_step(metrics, acc)
        return (self._finish_update(acc, 1),
                *gather_log_probs(e, out, parts, local.batch_size, local.response_length))

    def _finish_update(self, acc: dict[str, float], steps: int) -> dict[str, float]:
        """verl's actor/* metrics of one update_policy call (means over its optimizer steps)."""
        self.global_step += 1
        out = {f"actor/{k}": v / steps for k, v in acc.items() if k != "loss"}
        if not self.cfg.use_kl_loss:
            out.pop("actor/kl_loss", None)
        distill_loss = out.pop("actor/distill_loss", None)
        if self.loss_spec.distill_coef:  # algorithm.distill.mode=kl_loss
            out["distill/kl_loss"] = distill_loss
        out["actor/kl_coef"] = self.cfg.kl_loss_coef if self.cfg.use_kl_loss else 0.0
        out["actor/lr"] = current_lr(self.optimizer)
        out[N.PERF_PAD_FRACTION] = self.model.pad_fraction()  # padded / computed positions of this update (all DP)
        if self.model.is_moe:  # every rank: a pipeline stage of dense layers only has no probe but joins
            out.update(self._moe_metrics())
        return out

    def _moe_metrics(self) -> dict[str, float]:
        """moe/*: routing statistics of every forward since the last update (old log-probs, reference,
        update; replay mismatch vs the engine's ids) and the update's load-balancing loss."""
        from mrl.workers.routing_replay import (
            aux_loss_metrics,
            moe_layer_mask,
            routing_metrics,
        )

        cfg = self.model.config
        # a mixed dense/MoE model's dense layers route nothing
        layers = moe_layer_mask(self.model.router_probes, cfg.num_layers)
        m = routing_metrics(self.model.router_probes, moe_layers=layers, num_layers=cfg.num_layers,
                            num_experts=cfg.num_moe_experts)
        m.update(aux_loss_metrics(float(self.model.config.moe_aux_loss_coeff or 0.0),
                                  self._update_micro_batches, layers))
        self._update_micro_batches = 0
        return m

    # ---- weights, checkpoints, memory ---------------------------------------------------
    def export_hf_weights(self, *, only_lora: bool = False):
        """``(hf_name, tensor)`` of this rank's pipeline stage (TP-gathered): for weight sync. With LoRA
        the weights come merged (``W + (alpha/r)·B·A``); ``only_lora`` yields only the adapted ones."""
        return self.model.named_parameters_hf(only_lora=only_lora)

    def export_hf(self, out_dir: str | os.PathLike) -> None:
        """Write an HF checkpoint (safetensors + config) of the current weights; collective."""
        from mrl.workers.checkpointing import export_hf

        export_hf(self.model, out_dir)

    def save_checkpoint(self, ckpt_dir: str | os.PathLike, contents: list[str]) -> None:
        """verl's ``actor.checkpoint.save_contents``; collective. ``huggingface/`` gets the config and
        tokenizer files always (as verl: ``mrl-ckpt mcore-to-hf`` and SGLang want them) and the
        weights too with ``hf_model``."""
        from mrl.workers.checkpointing import HF_SUBDIR, save_hf_side_files

        if self.model.lora:  # before the weights: their completion marker then vouches for it too
            from mrl.megatron.lora import adapted_targets
            from mrl.megatron.lora_io import write_lora_meta

            write_lora_meta(ckpt_dir, self.cfg.lora, self.model.hf_path,
                            adapted_targets(self.cfg.lora.targets, self.model.hf_config))
        self.save(ckpt_dir, optimizer="optimizer" in contents, extra="extra" in contents)
        if "hf_model" in contents:
            self.export_hf(os.path.join(ckpt_dir, HF_SUBDIR))
        else:
            save_hf_side_files(self.model, os.path.join(ckpt_dir, HF_SUBDIR))

    def load_checkpoint(self, ckpt_dir: str | os.PathLike, contents: list[str]) -> None:
        """verl's ``actor.checkpoint.load_contents`` (model always; ``hf_model`` needs nothing here)."""
        from mrl.megatron.checkpoint import CheckpointError, read_checkpoint_metadata
        from mrl.megatron.lora import adapted_targets
        from mrl.megatron.lora_io import check_lora_matches

        check_lora_matches(ckpt_dir, self.cfg.lora, adapted_targets(self.cfg.lora.targets, self.model.hf_config))
        want_optim = "optimizer" in contents
        if want_optim and not read_checkpoint_metadata(ckpt_dir).get("has_optimizer"):
            raise CheckpointError(
                f"{ckpt_dir} was saved without optimizer state (actor.checkpoint.save_contents had no 'optimizer') "
                "but actor.checkpoint.load_contents asks for it; fix: actor.checkpoint.load_contents=[model,extra] "
                "(Adam and the LR schedule restart)")
        self.load(ckpt_dir, load_optimizer=want_optim, load_extra="extra" in contents)


    def compute_response_embedding(self, batch: TrainBatch) -> torch.Tensor:
        """[B, H] mean of the last layer's (final-norm) hidden states over each answer's tokens."""
        from mrl.workers.embedding import response_embedding

        return response_embedding(self.model, batch, micro_batch_size=self.cfg.ppo_micro_batch_size_per_gpu or 1)


@dataclasses.dataclass
class OldRouting:
    """R2's record: the old-log-prob forward's routing of a batch (``routing`` [B, S, layers, K], -1: no token) and
    that batch's ``input_ids`` (the update checks that it replays the batch it recorded)."""

    input_ids: torch.Tensor
    routing: torch.Tensor


class LogProbs(NamedTuple):
    log_probs: torch.Tensor  # [B, R]
    entropys: torch.Tensor  # [B, R]
    routing: torch.Tensor | None  # [B, S, layers, K] with record_routing, else None


def forward_log_probs(
    model: MegatronModel, batch: TrainBatch, *, temperature: float, micro_batch_size: int | None,
    use_dynamic_bsz: bool, max_tokens: int, vocab_size: int, chunk_size: int | None, shared_prefix: bool = False,
    record_routing: bool = False,
) -> LogProbs:
    """Forward-only log-probs/entropies of the full batch (shared by actor and reference); ``record_routing``: also
    the experts each router chose for every token (an MoE model), full batch in the caller's order on every rank."""
    local = model.dp_shard(batch)
    parts = micro_batch_parts(local, micro_batch_size=micro_batch_size or local.batch_size,
                              use_dynamic_bsz=use_dynamic_bsz, max_tokens=max_tokens * model.cp_size,
                              dp_group=model.dp_group, shared_prefix=shared_prefix,
                              min_parts=model.min_micro_batches)
    mbs = model.make_micro_batches(local, parts, shared_prefix=shared_prefix)
    fn = partial(log_prob_func, temperature=temperature, tp_group=model.tp_group,
                 vocab_size=vocab_size, chunk_size=chunk_size)
    model.set_train(False)
    with torch.no_grad(), (model.recording_routing() if record_routing else contextlib.nullcontext()) as rec:
        out = model.run(mbs, fn, forward_only=True)
    routing = None
    if rec is not None:
        routing = model.all_gather_dp(rec.local(parts).to(model.device)).cpu()
    return LogProbs(*gather_log_probs(model, out, parts, local.batch_size, local.response_length), routing)


def gather_log_probs(model: MegatronModel, out: list[dict], parts: list[list[int]], B: int, R: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batches' ``log_probs``/``entropys`` (last stage) -> the full batch's ([B_all, R], [B_all, R])
    in the caller's order, on every rank (pipeline broadcast, DP all-gather)."""
    if model.is_last_stage:
        lp = restore_order([o["log_probs"].float() for o in out], parts)
        ent = restore_order([o["entropys"].float() for o in out], parts)
    else:
        lp = torch.zeros(B, R, device=model.device)
        ent = torch.zeros(B, R, device=model.device)
    both = model.broadcast_from_last_stage(torch.stack([lp.to(model.device), ent.to(model.device)]))
    full = model.all_gather_dp(both.transpose(0, 1).contiguous())  # [B, 2, R]
    return full[:, 0].cpu(), full[:, 1].cpu()
