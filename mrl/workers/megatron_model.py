"""One Megatron model on this rank: build, load HF weights, run the pipeline schedule.

Shared by :class:`~mrl.workers.actor.ActorWorker`, the reference and the critic. It owns the
model chunks (one ``GPTModel`` per virtual pipeline stage, Megatron-DDP wrapped when trained)
and runs ``get_forward_backward_func()`` over a list of micro-batches; what happens to the
output on the last pipeline stage is the caller's ``loss_func``.

Attention layout: compact BSHD with a causal mask (:func:`mrl.workers.minibatch.build_model_inputs`),
which every attention backend runs; packed rows of whole sequences with ``remove_padding`` (sdpa backend,
:func:`mrl.workers.minibatch.build_packed_inputs`); one row per prompt with ``shared_prefix``. With PP > 1 all micro-batches of one
schedule call are padded to the same length (stages exchange one activation shape); with PP = 1 each
keeps its own (the fixed split groups samples of similar length). Their sample counts may differ
(dynamic micro-batching), so ``variable_seq_lengths`` is on whenever pipeline stages exchange activations. Megatron's RoPE
uses positions ``0..L-1`` of the compact row (it ignores ``position_ids``), which is what left-
aligned samples need. A vision-language model (:mod:`mrl.megatron.vision`) gets its 3-D multimodal RoPE positions from
each micro-batch's tokens and pictures (``TrainBatch.multi_modal``), and its first stage the pictures.
"""
from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from mrl.config.parallel import ParallelConfig
from mrl.megatron.unwrap import unwrap
from mrl.workers.batch import TrainBatch
from mrl.workers.minibatch import (
    ModelInputs,
    build_model_inputs,
    build_packed_inputs,
    build_shared_prefix_inputs,
)


def hf_tensor_getter(path: str | os.PathLike) -> Callable[[str], torch.Tensor]:
    """``name -> tensor`` over an HF checkpoint directory (:class:`mrl.megatron.hf_io.HFCheckpointReader`).

    A tied checkpoint (no ``lm_head.weight``) loaded into an untied model (the critic) reads the
    embedding for the head.
    """
    from mrl.megatron.hf_io import HFCheckpointReader

    reader = HFCheckpointReader(path)

    def get(name: str) -> torch.Tensor:
        if name == "lm_head.weight" and name not in reader and "model.embed_tokens.weight" in reader:
            name = "model.embed_tokens.weight"
        return reader.get(name)

    return get


@dataclass
class MicroBatch:
    """One micro-batch: packed model inputs plus per-sample [b, R] loss tensors."""

    inputs: ModelInputs
    data: TrainBatch
    extra: dict[str, Any] = field(default_factory=dict)


class MegatronModel:
    """Megatron model chunks of one role on this rank and the schedule that drives them.

    Args:
        hf_path: HF checkpoint directory (config.json + safetensors).
        parallel: TP/PP/VPP/CP/EP layout of this role.
        device: ``cpu`` (gloo, CPU support module) or ``cuda`` (NCCL).
        dtype: parameter dtype (fp32 on CPU; bf16 on CUDA).
        train: wrap in Megatron DDP (needed for an optimizer).
        ddp_config: Megatron ``DistributedDataParallelConfig`` (train only).
        use_distributed_optimizer: build DDP's param buffers for Megatron's DistributedOptimizer.
        value_head: replace the LM head with a scalar head (critic), see :meth:`_add_value_head`.
        score_head: ``hf_path`` is a ``*ForSequenceClassification`` reward model: the scalar head
            is its ``score.weight`` (see :mod:`mrl.workers.reward_model`); implies ``value_head``.
        init_parallel: call :func:`mrl.megatron.parallel.init_parallel` for ``parallel``.
        lora: ``actor.lora``; with ``rank > 0`` the base weights are frozen and adapters added
            (:mod:`mrl.megatron.lora`) before DDP, on Megatron's local layer spec.
        moe: ``actor.moe`` (token dispatcher, aux-loss weight, routing replay) for MoE models; the
            reference and critic pass the actor's so that their routing matches (ignored by dense models).
        remove_padding: ``actor.use_remove_padding`` as the run plan resolved it: micro-batches are packed rows
            of whole sequences (:func:`~mrl.workers.minibatch.build_packed_inputs`); needs the sdpa backend.
        attention_backend: ``te`` | ``sdpa`` | ``local`` as the run plan resolved it; None: ``parallel``'s
            ``attention_backend`` resolved on this host (:func:`mrl.megatron.provider.resolve_attention_backend`).
        recompute: ``<role>.recompute_granularity``: ``full`` recomputes every layer's activations in the backward
            (Megatron's uniform method, one layer per checkpoint: activation memory of one layer plus the layer
            inputs), ``selective`` only the core attention; None keeps every activation.
        freeze_vision_tower: ``actor.freeze_vision_tower`` (vision-language models): the tower's parameters get no
            gradient and stay out of DDP's buffers, hence out of the optimizer (ignored by text-only models).
    """

    def __init__(
        self,
        hf_path: str | os.PathLike,
        parallel: ParallelConfig,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 1234,
        train: bool = True,
        ddp_config: Any = None,
        use_distributed_optimizer: bool = False,
        value_head: bool = False,
        init_parallel: bool = True,
        timeout_s: int = 300,
        lora: Any = None,
        score_head: bool = False,
        moe: Any = None,
        remove_padding: bool = False,
        attention_backend: str | None = None,
        recompute: str | None = None,
        freeze_vision_tower: bool = True,
    ) -> None:
        from megatron.core import parallel_state as ps

        from mrl.megatron import parallel as mpar
        from mrl.megatron.provider import (
            build_model_chunks,
            load_hf_config,
            resolve_attention_backend,
        )

        cp = parallel.context_parallel_size
        if cp > 1 and not remove_padding:  # mrl plan refuses it first (mrl/config/validate_parallel.py)
            raise ValueError("megatron.context_parallel_size > 1 runs on packed rows: set actor.use_remove_padding "
                             "(with attention_backend=sdpa)")
        if init_parallel:
            mpar.init_parallel(
                device=device, tp=parallel.tensor_model_parallel_size,
                pp=parallel.pipeline_model_parallel_size,
                vpp=parallel.virtual_pipeline_model_parallel_size,
                cp=cp, ep=parallel.expert_model_parallel_size, etp=parallel.etp, seed=seed, timeout_s=timeout_s,
            )
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self.dtype = dtype
        self.hf_path = str(hf_path)
        self.hf_config = load_hf_config(hf_path)
        value_head = value_head or score_head
        if score_head:
            self.hf_config = as_causal_lm_config(self.hf_config, hf_path)
        self.parallel = parallel
        self.value_head = value_head
        overrides: dict[str, Any] = {"sequence_parallel": parallel.sequence_parallel, **parallel.uneven_stages,
                                     **_recompute_overrides(recompute)}
        from mrl.families import family_of
        from mrl.megatron.moe import is_moe_family
        from mrl.megatron.provider import model_family

        self.is_moe = is_moe_family(model_family(self.hf_config))
        self.routing_replay = bool(self.is_moe and moe is not None and moe.routing_replay != "none")
        if self.is_moe and moe is not None:
            overrides["moe_token_dispatcher_type"] = moe.token_dispatcher
            overrides["moe_enable_routing_replay"] = self.routing_replay
            if moe.aux_loss_coef is not None:
                overrides["moe_aux_loss_coeff"] = moe.aux_loss_coef
        self.lora = lora if lora is not None and lora.enabled else None
        self.attention_backend = resolve_attention_backend(attention_backend or parallel.attention_backend,
                                                           lora=self.lora is not None,
                                                           mla=family_of(self.hf_config).is_mla,
                                                           hybrid=family_of(self.hf_config).is_hybrid)
        if remove_padding and self.attention_backend != "sdpa":
            raise ValueError(f"packed micro-batches (actor.use_remove_padding) need the sdpa attention backend, this "
                             f"model runs {self.attention_backend}; fix: megatron.attention_backend=sdpa")
        if cp > 1 and self.attention_backend != "sdpa":
            raise ValueError(f"megatron.context_parallel_size={cp} runs on the sdpa attention backend only, this model "
                             f"runs {self.attention_backend}; fix: megatron.attention_backend=sdpa")
        self.remove_padding = remove_padding
        chunks = build_model_chunks(
            self.hf_config, dtype=dtype, wrap_ddp=False, config_overrides=overrides,
            share_embeddings_and_output_weights=False if value_head else None,
            attention_backend=self.attention_backend,
        )
        if self.device.type == "cuda":
            # As Megatron-LM's get_model: modules Megatron does not place itself (torch norms without
            # Apex/TE) are built on the host. DDP's buffers moved them for trained roles; a frozen one
            # (the reward model) kept CPU norm weights — found by the first run on a GPU.
            chunks = [c.cuda(self.device) for c in chunks]
        if score_head:
            load_reward_model(self, chunks, hf_tensor_getter(hf_path))
        else:
            self.load_hf(hf_path, chunks)
        if self.lora:
            from mrl.megatron.lora import apply_lora

            apply_lora(chunks, self.hf_config, targets=self.lora.targets, rank=self.lora.rank,
                       alpha=self.lora.alpha, dropout=self.lora.dropout, seed=seed)
        if value_head and not score_head:
            for c in chunks:
                self._add_value_head(c, seed)
        from mrl.megatron.vision import vision_tower_of

        self.vision = vision_tower_of(self.hf_config)  # a vision-language model's tower (first stage), else None
        if self.vision is not None and freeze_vision_tower:
            for c in chunks:  # before DDP: its buffers, hence the optimizer, hold trainable parameters only
                tower = getattr(unwrap(c), "vision_model", None)
                if tower is not None:
                    tower.requires_grad_(False)
        if train:
            from megatron.core.distributed import (
                DistributedDataParallel,
                DistributedDataParallelConfig,
            )

            if self.is_moe:
                # Megatron gives routed experts their own grad buffers and optimizer (reduced over the
                # expert-data-parallel group) only when EP > 1; at EP = 1 they join the dense ones. Always
                # separate (at EP = 1 the expert-DP group is the DP group: same reduction), so that the
                # optimizer state has one structure and a checkpoint resumes at any EP.
                for c in chunks:
                    for name, p in c.named_parameters():
                        if ".mlp.experts." in name:
                            p.allreduce = False
            # The DistributedOptimizer needs DDP's contiguous param buffers (use_distributed_optimizer).
            ddp_config = ddp_config or DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer)
            chunks = [
                DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
                for i, c in enumerate(chunks)
            ]
        else:
            for c in chunks:
                c.requires_grad_(False)
        self.chunks: list[torch.nn.Module] = chunks
        self.config = unwrap(chunks[0]).config
        from mrl.megatron.rope_positions import enable_rope_positions

        for c in chunks:  # shared-prefix and packed rows rotate by position_ids (off until a batch sets them)
            enable_rope_positions(unwrap(c))
        # Set after construction: the config validator refuses it with the (unused, dense) MoE
        # allgather dispatcher, but the p2p shape exchange it enables is all we need.
        self.config.variable_seq_lengths = True
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        if len(chunks) > 1:
            # Interleaved stages (VPP) send activations and gradients the same way at once. Megatron's batched p2p
            # (core's default) posts [send prev, send next] against the peer's [recv prev, recv next]: at PP=2, where
            # prev and next are the same rank, activations and gradients of equal shape were swapped (silently
            # wrong losses from the third micro-batch on) or the ranks hung. Megatron-LM's own VPP settings post
            # them in matching order, each direction on its own communicator.
            self.config.batch_p2p_comm = False
            self.config.overlap_p2p_comm = True
        # the interleaved schedule runs at least PP micro-batches per call (the splitters take this many)
        self.min_micro_batches = self.pp_size if len(chunks) > 1 else 1
        if train:
            from megatron.core.distributed import finalize_model_grads

            # Megatron-LM's wiring: grads are all-reduced over DP (and embedding grads across the
            # first/last stage) once, after the last micro-batch.
            self.config.finalize_model_grads_func = finalize_model_grads
            self.config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.pp_last_rank = ps.get_pipeline_model_parallel_last_rank()
        self.is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.pad_to_multiple = ps.get_tensor_model_parallel_world_size() if parallel.sequence_parallel else 1
        # context parallelism: each sequence of a packed row padded to 2·CP (·TP with SP) and cut in zigzag chunks
        self.cp_size = ps.get_context_parallel_world_size()
        self.cp_group = ps.get_context_parallel_group() if self.cp_size > 1 else None
        self.dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
        self.router_probes: list = []
        self.routing_record: Any = None  # a RoutingRecord while recording_routing() is active
        self.positions = torch.zeros(2, dtype=torch.long)  # [computed, padding] positions since pad_fraction()
        if self.is_moe:  # routing statistics always; the engine's expert choice replayed when routing_replay is on
            from mrl.workers.routing_replay import install_probes

            self.router_probes = install_probes(chunks)

    # ---- weights -------------------------------------------------------------------------
    def load_hf(self, hf_path: str | os.PathLike, chunks: list | None = None) -> None:
        """Fill this rank's shards from an HF checkpoint (value head untouched)."""
        from mrl.megatron.mapping import load_hf_weights

        load_hf_weights(chunks if chunks is not None else self.chunks, self.hf_config, hf_tensor_getter(hf_path))

    def _add_value_head(self, chunk: torch.nn.Module, seed: int) -> None:
        """Critic head: ``V = w·h`` with ``w ∈ R^H`` replacing the vocab-parallel LM head.

        The head is replicated over TP (hidden states are replicated after the final norm), so
        every TP rank computes the same [b, s, 1] values and the same head gradient.
        """
        model = unwrap(chunk)
        if not model.post_process:
            return
        hidden = self.hf_config.hidden_size
        g = torch.Generator().manual_seed(seed)
        head = _ValueHead(hidden, self.dtype)
        with torch.no_grad():
            head.weight.copy_(torch.randn(1, hidden, generator=g) * hidden ** -0.5)
        model.output_layer = head.to(self.device)

    def named_parameters_hf(self, *, only_lora: bool = False):
        """``(hf_name, full tensor)`` of this rank's pipeline stage (TP-gathered); LM models only.
        With LoRA the adapted weights come merged; ``only_lora``: just those."""
        from mrl.megatron.mapping import export_hf_weights

        return export_hf_weights(self.chunks, self.hf_config, only_lora=only_lora)

    # ---- schedule --------------------------------------------------------------------------
    def run(
        self,
        micro_batches: list[MicroBatch],
        loss_func: Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict]],
        *,
        forward_only: bool,
        hidden_hook: Callable[[MicroBatch, torch.Tensor], None] | None = None,
    ) -> list[dict]:
        """One ``get_forward_backward_func()`` call over ``micro_batches``.

        ``loss_func(mb, output)`` runs on the last pipeline stage with ``output`` = logits
        [b, L, V/TP] (or values [b, L, 1]); it returns ``(loss, metrics)`` — Megatron divides
        ``loss`` by ``len(micro_batches)`` and DDP averages gradients over DP, which the caller's
        loss scaling must cancel. Returns the metrics dicts (last stage; ``[]`` elsewhere).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from mrl.megatron.rope_positions import set_rope_positions

        # the whole rows' length (with CP Megatron's schedule divides it by CP for the stages' activation shapes)
        seq_len = max(mb.inputs.full_length() for mb in micro_batches)
        if dist.get_world_size(self.pp_group) > 1:  # one length per call: pipeline stages exchange [L, b, H]
            for mb in micro_batches:
                _pad_inputs(mb.inputs, seq_len)
        if self.cp_group is not None:  # this rank's zigzag share of every packed row
            from mrl.workers.minibatch import shard_for_cp

            if hidden_hook is not None:
                raise ValueError("context parallelism: hidden-state readers (response embeddings, repr_align) are "
                                 "not supported; set megatron.context_parallel_size=1")
            for mb in micro_batches:
                mb.inputs = shard_for_cp(mb.inputs, self.cp_group)
        handles = []
        current: list[MicroBatch] = []
        if hidden_hook is not None:
            for c in self.chunks:
                m = unwrap(c)
                if m.post_process:
                    handles.append(m.decoder.final_layernorm.register_forward_hook(
                        lambda _mod, _inp, out: hidden_hook(current[-1], out)))

        for mb in micro_batches:
            self.positions += torch.tensor([mb.inputs.tokens.numel(), mb.inputs.padding()])
        if self.routing_record is not None:
            self.routing_record.micro_batches.extend(micro_batches)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            current.append(mb)
            inp = mb.inputs
            pos = inp.position_ids.to(self.device)
            shared = inp.attention_mask is not None  # shared-prefix rows: RoPE at position_ids, block mask
            packed = inp.cu_seqlens is not None  # packed rows: RoPE at position_ids, attention within sequences
            if self.vision is not None:  # 3-D positions on every stage, the pictures for the first one's tower
                self._set_vision(unwrap(model), mb)
                set_rope_positions(unwrap(model), None)
            else:
                set_rope_positions(unwrap(model), pos if shared or packed else None)
            if self.router_probes:
                self._route(inp)
            # MoE: padding positions route too, but stay out of the router's aux losses (every layout then
            # balances over the same tokens); dense models and rows without padding take no padding mask. Under
            # CP every rank passes one (Megatron reduces the routers' token counts over TP x CP and reads the total
            # from the mask only when it has one: a share without padding must not count its columns instead)
            pad = inp.padding_mask() if self.is_moe and (inp.padding() or inp.cp_cols is not None) else None
            out = model(
                input_ids=inp.tokens.to(self.device), position_ids=pos,
                attention_mask=inp.attention_mask.to(self.device) if shared else None,
                packed_seq_params=_packed_seq_params(inp, self.device, self.config) if packed else None,
                **({"padding_mask": pad.to(self.device)} if pad is not None else {}),
            )
            return out, partial(loss_func, mb)

        n = len(micro_batches)
        if len(self.chunks) > 1:
            self.config.microbatch_group_size_per_vp_stage = vpp_group_size(n, self.pp_size)
        iters = [iter(micro_batches) for _ in self.chunks]
        try:
            out = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iters if len(iters) > 1 else iters[0],
                model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
                num_microbatches=n,
                seq_length=seq_len,
                micro_batch_size=max(int(mb.inputs.tokens.shape[0]) for mb in micro_batches),
                forward_only=forward_only,
            )
        finally:
            for h in handles:
                h.remove()
            if self.router_probes:
                from mrl.workers.routing_replay import set_targets

                set_targets(self.router_probes, None)  # no stale ids for a later forward
        return list(out) if out else []

    def _set_vision(self, model: torch.nn.Module, mb: MicroBatch) -> None:
        """A vision-language model's next forward: the 3-D RoPE positions of ``mb``'s rows (each sequence from 0) and,
        on the first stage, its samples' pictures in row order (:mod:`mrl.megatron.vision`)."""
        from mrl.megatron.vision import (
            batch_pictures,
            mrope_positions,
            picture_tokens,
            set_vision_inputs,
        )

        inp = mb.inputs
        if inp.attention_mask is not None:
            raise ValueError("actor.shared_prefix with a vision-language model is not supported; fix: "
                             "actor.shared_prefix=false")
        pixels, grid, grids = batch_pictures(mb.data.multi_modal, self.device)
        merge = int(getattr(self.hf_config, "mrl_vision_config", {}).get("spatial_merge_size", 2))
        where = {"image_token": int(self.hf_config.image_token_id), "merge": merge}
        pos = mrope_positions(inp.tokens, inp.num_tokens, inp.cu_seqlens, grids, **where)
        mask = picture_tokens(inp.tokens, inp.num_tokens, inp.cu_seqlens, grids, **where)
        set_vision_inputs(model, pos.to(self.device), pixels, grid, mask.to(self.device))

    @contextlib.contextmanager
    def recording_routing(self) -> Iterator[Any]:
        """Inside the block every router keeps the experts it chose (``actor.moe.routing_replay=old``, R2):
        yields a :class:`~mrl.workers.routing_replay.RoutingRecord` to read after the forwards."""
        from mrl.workers.routing_replay import RoutingRecord

        if not self.router_probes:
            raise RuntimeError("recording the routing needs a Mixture-of-Experts model (this one has no router)")
        rec = RoutingRecord(self)
        for p in self.router_probes:
            p.records = []
        self.routing_record = rec
        try:
            yield rec
        finally:
            rec.per_layer = {p.layer: p.records for p in self.router_probes}
            for p in self.router_probes:
                p.records = None
            self.routing_record = None

    def _route(self, inp: ModelInputs) -> None:
        """Point the router probes at this micro-batch's engine ids (replay) or at none (own routing)."""
        from megatron.core import parallel_state as ps

        from mrl.workers.routing_replay import set_targets

        routed = inp.routed_experts.to(self.device) if self.routing_replay and inp.routed_experts is not None else None
        sp = self.parallel.sequence_parallel
        set_targets(self.router_probes, routed, sp_rank=ps.get_tensor_model_parallel_rank() if sp else 0,
                    sp_size=ps.get_tensor_model_parallel_world_size() if sp else 1)

    def pad_fraction(self, *, reset: bool = True) -> float:
        """``perf/pad_fraction``: padded positions / positions computed by this DP group's forwards since the last
        reset (summed over DP and CP ranks: with CP each rank counts its share of the rows; 0.0 when nothing
        ran)."""
        t = self.positions.to(self.device).clone()
        if dist.get_world_size(self.dp_cp_group) > 1:
            dist.all_reduce(t, group=self.dp_cp_group)
        t = t.cpu()
        if reset:
            self.positions.zero_()
        return float(t[1]) / float(t[0]) if int(t[0]) else 0.0

    def set_train(self, mode: bool) -> None:
        for c in self.chunks:
            c.train(mode)

    # ---- collectives -----------------------------------------------------------------------
    def broadcast_from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        """Send the last pipeline stage's ``t`` to every stage (shape must be known everywhere)."""
        if dist.get_world_size(self.pp_group) > 1:
            t = t.contiguous()
            dist.broadcast(t, src=self.pp_last_rank, group=self.pp_group)
        return t

    def all_gather_dp(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-shaped per-DP-rank tensors along dim 0 in DP-rank order."""
        if self.dp_size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.dp_size)]
        dist.all_gather(parts, t.contiguous(), group=self.dp_group)
        return torch.cat(parts, 0)

    def all_reduce_dp(self, t: torch.Tensor) -> torch.Tensor:
        if self.dp_size > 1:
            dist.all_reduce(t, group=self.dp_group)
        return t

    def dp_shard(self, batch: TrainBatch) -> TrainBatch:
        """This DP rank's contiguous slice of a full batch (every rank gets the full batch)."""
        B = batch.batch_size
        if B % self.dp_size != 0:
            raise ValueError(
                f"batch of {B} samples is not divisible by the data-parallel size {self.dp_size}; "
                "make train_batch_size*rollout.n a multiple of the DP size"
            )
        per = B // self.dp_size
        return batch.slice(self.dp_rank * per, (self.dp_rank + 1) * per)

    def make_micro_batches(self, data: TrainBatch, parts: list[list[int]], *, shared_prefix: bool = False,
                           packed: bool | None = None) -> list[MicroBatch]:
        """The micro-batches of ``parts``: with ``shared_prefix`` one row per prompt
        (:func:`~mrl.workers.minibatch.build_shared_prefix_inputs`), else with ``packed`` (None: this model's
        ``remove_padding``) one packed row per part (:func:`~mrl.workers.minibatch.build_packed_inputs`), else
        compact right-padded rows. Outputs are per position, read through ``gather_response``; callers that
        read compact columns themselves (reward-model scores, response embeddings) pass ``packed=False``."""
        if shared_prefix:
            self.check_shared_prefix()
            build = build_shared_prefix_inputs
        elif self.remove_padding if packed is None else packed:
            build = build_packed_inputs
        else:
            build = build_model_inputs
        kw: dict[str, Any] = {"pad_to_multiple": self.pad_to_multiple}
        if self.cp_size > 1:
            if build is not build_packed_inputs:
                raise ValueError("megatron.context_parallel_size > 1 needs packed rows (actor.use_remove_padding, no "
                                 "shared_prefix); this role reads compact rows (reward model scores, embeddings): "
                                 "set its megatron.context_parallel_size=1")
            kw = {"seq_multiple": 2 * self.cp_size * self.pad_to_multiple}  # zigzag chunks (· TP shards with SP)
        out = []
        for p in parts:
            sub = data.index(p)
            out.append(MicroBatch(build(sub, **kw), sub))
        return out

    def check_shared_prefix(self) -> None:
        """The shared-prefix layout needs attention that applies an arbitrary mask: mrl's SDPA module or Megatron's
        local ``DotProductAttention`` (unfused softmax); Transformer Engine's causal kernels ignore the mask."""
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        from mrl.megatron.sdpa_attention import SDPAAttention

        core = unwrap(self.chunks[0]).decoder.layers[0].self_attention.core_attention
        if not isinstance(core, (DotProductAttention, SDPAAttention)) or self.config.masked_softmax_fusion:
            raise ValueError(f"actor.shared_prefix needs the sdpa or local attention backend, this model runs "
                             f"{type(core).__name__}; fix: actor.shared_prefix=false")


class _ValueHead(torch.nn.Module):
    """Scalar value head with the ``output_layer`` call signature of ``GPTModel``."""

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden, dtype=dtype))

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden_states, self.weight), None


def _recompute_overrides(recompute: str | None) -> dict[str, Any]:
    """TransformerConfig fields of ``recompute_granularity`` (Megatron-LM's ``--recompute-*`` flags)."""
    if recompute is None:
        return {}
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if recompute == "selective":
        return {"recompute_granularity": "selective"}  # Megatron's default module list: core attention
    raise ValueError(f"recompute_granularity={recompute!r}: expected full, selective or null")


def _packed_seq_params(inp: ModelInputs, device: torch.device, config: Any):
    """Megatron's ``PackedSeqParams`` of a packed row, as :class:`~mrl.megatron.sdpa_attention.SDPAAttention` reads
    it: ``qkv_format="sbhd"`` keeps Megatron on the ``[s, b]`` layout (its THD path is Transformer Engine's).
    Multi-latent attention reads any packed row as THD (it drops the batch dim and applies RoPE per sequence by
    ``cu_seqlens``), so MLA models get ``"thd"``; the SDPA core attention takes both."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = inp.cu_seqlens.to(device, torch.int32)  # type: ignore[union-attr]
    longest = int((inp.cu_seqlens[1:] - inp.cu_seqlens[:-1]).max())  # type: ignore[index]
    fmt = "thd" if getattr(config, "multi_latent_attention", False) else "sbhd"
    return PackedSeqParams(qkv_format=fmt, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def vpp_group_size(n: int, pp: int) -> int:
    """Micro-batches per virtual-stage group of Megatron's interleaved schedule for ``n`` micro-batches at PP ``pp``:
    the schedule needs pp <= N <= n and the last group empty or of at least pp (``n % N == 0 or n % N >= pp``).
    PP itself when it fits (Megatron-LM's default, the shortest pipeline bubble), else the smallest N that does;
    ``n`` itself always does. A token-budget split's count is data-dependent, so this is chosen per call."""
    if n < pp:
        raise ValueError(f"the interleaved pipeline (virtual_pipeline_model_parallel_size) runs at least "
                         f"pipeline_model_parallel_size={pp} micro-batches per call, this rank's batch makes {n} "
                         f"(at most one per sample); fix: "
                         f"more samples per mini-batch and DP rank (ppo_mini_batch_size x rollout.n / DP >= {pp}), or "
                         "virtual_pipeline_model_parallel_size=null")
    return next(g for g in range(pp, n + 1) if n % g == 0 or n % g >= pp)


def _pad_inputs(inp: ModelInputs, length: int) -> None:
    extra = length - int(inp.tokens.shape[1])
    if extra > 0 and inp.cp_cols is not None:
        raise ValueError("a micro-batch already cut into its CP share cannot be padded for the pipeline; build it anew")
    if extra > 0:
        if inp.cu_seqlens is not None:  # new columns: one more (padding) sequence of the packed row
            inp.cu_seqlens = torch.cat([inp.cu_seqlens, inp.cu_seqlens[-1:] + extra])
        pad = lambda t: torch.nn.functional.pad(t, (0, extra))
        inp.tokens, inp.position_ids, inp.labels = pad(inp.tokens), pad(inp.position_ids), pad(inp.labels)
        if inp.routed_experts is not None:  # new columns: no engine ids
            inp.routed_experts = torch.nn.functional.pad(inp.routed_experts, (0, 0, 0, 0, 0, extra), value=-1)
        if inp.attention_mask is not None:  # new columns: attended by nothing, attending to themselves only
            m = torch.nn.functional.pad(inp.attention_mask, (0, extra, 0, extra), value=True)
            idx = torch.arange(length - extra, length)
            m[:, :, idx, idx] = False
            inp.attention_mask = m


_SEQ_CLS = "ForSequenceClassification"


def as_causal_lm_config(hf_config: Any, path: str | os.PathLike) -> Any:
    """A copy of an RM's config naming the causal-LM architecture of the same body (for the
    model builder's family table); anything but a one-label sequence classifier is refused."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if len(archs) != 1 or not archs[0].endswith(_SEQ_CLS):
        raise ValueError(
            f"reward model {str(path)!r} has architectures {archs}, not a *{_SEQ_CLS} checkpoint; fix: point "
            f"the reward model path at e.g. a Qwen2{_SEQ_CLS} / Llama{_SEQ_CLS} checkpoint with num_labels=1")
    if getattr(hf_config, "num_labels", 1) != 1:
        raise ValueError(f"reward model {str(path)!r} has num_labels={hf_config.num_labels}; a reward model "
                         "outputs one scalar (num_labels=1)")
    out = copy.deepcopy(hf_config)
    out.architectures = [archs[0][: -len(_SEQ_CLS)] + "ForCausalLM"]
    return out


def load_reward_model(mm: MegatronModel, chunks: list, get: Callable[[str], torch.Tensor]) -> None:
    """Body weights from ``model.*``, then ``score.weight`` as the last stage's scalar head."""
    from mrl.megatron.mapping import load_hf_weights

    def body(name: str) -> torch.Tensor:
        # The builder makes an LM head (untied: value heads never share the embedding) that the
        # score head replaces below; the RM has none, so the embedding fills it meanwhile.
        return get("model.embed_tokens.weight" if name == "lm_head.weight" else name)

    load_hf_weights(chunks, mm.hf_config, body)
    score = get("score.weight")
    hidden = mm.hf_config.hidden_size
    if tuple(score.shape) != (1, hidden):
        raise ValueError(f"reward model score.weight has shape {tuple(score.shape)}, expected (1, {hidden})")
    for c in chunks:
        model = unwrap(c)
        if model.post_process:
            head = _ValueHead(hidden, mm.dtype)
            with torch.no_grad():
                head.weight.copy_(score)
            model.output_layer = head.to(mm.device)
