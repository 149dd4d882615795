"""MoE routing on the trainer side: replay of the engine's expert choice (R3) and routing statistics.

One :class:`RouterProbe` sits on every ``TopKRouter`` of an MoE model (a forward pre-hook and a forward
hook). When a micro-batch carries the engine's ids, the pre-hook recomputes the router's own logits with
the router's own ``gating`` (same op, same dtype) and the experts its own rule picks from them (Megatron's
routing function with the router's settings: a sigmoid router with a score-correction bias and group limits
does not pick the top-k logits) and then:

* **replay** (a micro-batch carries the engine's ids, ``actor.moe.routing_replay=rollout``): sets
  Megatron's ``RouterReplay`` target to the engine's top-k ids, so the router gathers *its own*
  probabilities at the *engine's* experts (``probs = scores.gather(1, ids)``; normalised over the
  k as the model's config says). Positions the engine never ran (padding, a response's last token:
  id ``-1``) keep the trainer's own choice — nothing kept depends on their output.
* **measure**: ``mismatch`` counts tokens (with engine ids) whose own top-k *set* differs from the
  engine's — ``moe/replay_mismatch``; the forward hook counts assignments per expert ``load[e]`` from the
  router's ``routing_map`` (the routing the layer actually used, replayed or its own), from which ``moe/load_entropy`` (``-Σ f_e log f_e / log E`` of the assignment shares
  ``f_e``, 1 = balanced) and ``moe/max_load_frac`` (``max_e f_e``, ``1/E`` when balanced) follow.

* **record** (``actor.moe.routing_replay=old``, R2): inside :meth:`MegatronModel.recording_routing
  <mrl.workers.megatron_model.MegatronModel.recording_routing>` the forward hook keeps each forward's
  choice (the top-k ids of the router's ``routing_map``); :class:`RoutingRecord` lays them out as
  ``[B, S, layers, K]`` aligned with ``input_ids`` — the layout the engine's ids have — so the update replays them
  as R3 replays the engine's.

Token order: Megatron runs ``[s, b, h]`` activations and flattens them s-major, so target row
``t·b + i`` is column ``t`` of sample ``i`` of the compact micro-batch (with sequence parallelism
each TP rank holds a contiguous chunk of ``s``).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist


class RouterProbe:
    """Hooks on one router (global MoE layer ``layer``); see the module docstring. The counters stay on the
    router's device (no host sync in the forward); :func:`routing_metrics` reads them once per update."""

    def __init__(self, router: Any, layer: int, num_experts: int) -> None:
        self.router, self.layer = router, layer
        self.target: torch.Tensor | None = None  # [tokens, K], -1 = no engine id
        device = router.weight.device
        self.load = torch.zeros(num_experts, dtype=torch.float64, device=device)
        self.mismatch = torch.zeros((), dtype=torch.long, device=device)
        self.compared = torch.zeros((), dtype=torch.long, device=device)
        self.measure = True  # off while the colocated reference borrows the model (its routing is not the policy's)
        self.records: list[torch.Tensor] | None = None  # while recording: each forward's [tokens, K] choice
        router.register_forward_pre_hook(self._pre)
        router.register_forward_hook(self._post)

    def _pre(self, module: Any, args: tuple) -> None:
        """With engine ids: the router's own top-k (one extra router GEMM, only then), the mismatch count,
        and the replay target (engine ids; own choice where the engine ran none)."""
        replay = module.router_replay
        if self.target is None:
            if replay is not None:
                replay.clear_router_replay_action()
            return
        with torch.no_grad():
            own = _own_topk(module, module.gating(args[0].detach()).reshape(-1, module.config.num_moe_experts))
            target = self.target.to(own.device)
            if target.shape != own.shape:
                raise RuntimeError(f"routing replay: layer {self.layer} got {tuple(target.shape)} engine ids for "
                                   f"{tuple(own.shape)} router tokens (micro-batch layout mismatch)")
            known = (target >= 0).all(-1)
            if self.measure:
                self._follow(own.device)
                same = (own.sort(-1).values == target.sort(-1).values).all(-1)
                self.mismatch += (known & ~same).sum()
                self.compared += known.sum()
        if replay is not None:
            from megatron.core.transformer.moe.router_replay import RouterReplayAction

            replay.clear_indices()
            replay.set_target_indices(torch.where(known[:, None], target, own))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def _post(self, module: Any, args: tuple, output: tuple) -> None:
        """Assignments per expert from the routing the layer used (the router's ``routing_map``), padding
        positions left out (the padding mask the MoE layer passes its router, ``[s, b]`` True = padding,
        flattened s-major as the routing map's rows)."""
        if self.measure:
            self._follow(output[1].device)
            used = output[1].detach()
            pad = args[1] if len(args) > 1 else None
            if pad is not None:
                used = used & ~pad.reshape(-1, 1).to(used.device)
            self.load += used.sum(0).to(self.load.dtype)
        if self.records is not None:
            self.records.append(chosen_experts(output[1].detach(), module.topk))

    def _follow(self, device: torch.device) -> None:
        """Counters on the device the router runs on (a model moved after the probe was built, or offloaded)."""
        if self.load.device != device:
            self.load, self.mismatch, self.compared = (t.to(device) for t in (self.load, self.mismatch, self.compared))

    def reset(self) -> None:
        self.load.zero_()
        self.mismatch.zero_()
        self.compared.zero_()


def _own_topk(router: Any, logits: torch.Tensor) -> torch.Tensor:
    """``[tokens, K]`` experts the router picks itself from ``logits``, by its own rule (Megatron's routing function
    with the router's settings: softmax top-k, or DeepSeek's sigmoid + score-correction bias + group-limited top-k,
    where the top-k logits are not the choice); no replay, no host sync (a top-k of the 0/1 routing map)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    cfg = router.config
    _, routing_map = topk_routing_with_score_function(
        logits, router.topk, use_pre_softmax=cfg.moe_router_pre_softmax, num_groups=cfg.moe_router_num_groups,
        group_topk=cfg.moe_router_group_topk, scaling_factor=cfg.moe_router_topk_scaling_factor,
        score_function=cfg.moe_router_score_function, expert_bias=getattr(router, "expert_bias", None))
    return routing_map.to(logits.dtype).topk(router.topk, dim=1).indices


def chosen_experts(routing_map: torch.Tensor, k: int) -> torch.Tensor:
    """[tokens, E] bool routing map (k experts per token: routing is dropless) -> [tokens, k] int32 ids, ascending.
    The set is what replay needs: Megatron scatters the ids' probabilities into the map, so their order is moot."""
    order = torch.sort(routing_map.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :k]
    return order.sort(dim=1).values.to(torch.int32)


def install_probes(chunks: list) -> list[RouterProbe]:
    """A probe on every router of ``chunks`` (global layer index from the MoE layer's layer_number)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from mrl.megatron.unwrap import unwrap

    probes = []
    for c in chunks:
        for layer in unwrap(c).decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if isinstance(router, TopKRouter):
                probes.append(RouterProbe(router, layer.layer_number - 1, router.config.num_moe_experts))
    return probes


def set_targets(probes: list[RouterProbe], routed: torch.Tensor | None, *, sp_rank: int = 0, sp_size: int = 1) -> None:
    """Point every probe at its layer's ids of this micro-batch: ``routed`` [b, L, layers, K] (None: own routing)."""
    for p in probes:
        if routed is None:
            p.target = None
            continue
        t = routed[:, :, p.layer, :].transpose(0, 1)  # [L, b, K], Megatron's s-major order
        if sp_size > 1:
            t = t.chunk(sp_size, dim=0)[sp_rank]
        p.target = t.reshape(-1, t.shape[-1])


def moe_layer_mask(probes: list[RouterProbe], num_layers: int | None = None) -> torch.Tensor:
    """[num_layers] bool: the global layers that route (a probe on some rank). Models mixing dense and MoE layers
    (``moe_layer_freq``) have dense layers without a router, which the ``moe/*`` means must leave out. Collective
    over the world when torch.distributed is initialised: a pipeline stage holding only dense layers has no probe
    and still takes part (``num_layers``, the model's global layer count, is then required)."""
    total_layers = num_layers if num_layers is not None else probes[0].router.config.num_layers
    mask = torch.zeros(total_layers, dtype=torch.float64)
    for p in probes:
        mask[p.layer] = 1.0
    if dist.is_initialized():
        dist.all_reduce(mask)
    return mask > 0


def routing_metrics(probes: list[RouterProbe], *, reset: bool = True, moe_layers: torch.Tensor | None = None,
                    num_layers: int | None = None, num_experts: int | None = None) -> dict[str, float]:
    """``moe/*`` metrics over every rank (collective over the world: call on all ranks together), averaged over the
    MoE layers (``moe_layers``, :func:`moe_layer_mask`; None: computed here). A rank without probes (a pipeline
    stage of dense layers only) takes part when given the model's ``num_layers`` and ``num_experts``."""
    if not probes and (num_layers is None or num_experts is None):
        return {}
    if moe_layers is None:
        moe_layers = moe_layer_mask(probes, num_layers)
    num_experts = probes[0].load.numel() if probes else int(num_experts)
    stats = torch.tensor([float(sum(p.mismatch for p in probes)), float(sum(p.compared for p in probes))],
                         dtype=torch.float64)
    # Layers differ across pipeline stages: per-layer loads by global layer index (config.num_layers is global).
    total_layers = probes[0].router.config.num_layers if probes else int(num_layers)
    per_layer = torch.zeros(total_layers, num_experts, dtype=torch.float64)
    for p in probes:
        per_layer[p.layer] += p.load.cpu()
    if dist.is_initialized():
        dist.all_reduce(stats)
        dist.all_reduce(per_layer)
    if reset:
        for p in probes:
            p.reset()
    frac = per_layer / per_layer.sum(-1, keepdim=True).clamp_min(1)
    ent = -(frac * frac.clamp_min(1e-30).log()).sum(-1) / torch.log(torch.tensor(float(num_experts)))
    out = {
        "moe/load_entropy": float(ent[moe_layers].mean()),
        "moe/max_load_frac": float(frac.max(-1).values[moe_layers].mean()),
    }
    for i in torch.nonzero(moe_layers).flatten().tolist():
        out[f"moe/layer{i}/max_load_frac"] = float(frac[i].max())
    if stats[1] > 0:
        out["moe/replay_mismatch"] = float(stats[0] / stats[1])
    return out


def aux_loss_metrics(coef: float, num_micro_batches: int, moe_layers: torch.Tensor | None = None) -> dict[str, float]:
    """``moe/aux_loss``: coef × the load-balancing loss Megatron tracked in the last update, averaged over
    the MoE layers (``moe_layers``; None: every layer), micro-batches and data-parallel ranks (collective over the
    world); clears the tracker."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    if coef == 0.0:  # Megatron computes no aux loss then; a tracker entry is an earlier model's in this process
        return {}
    tracker = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    if tracker is None and moe_layers is None:
        return {}
    # a pipeline stage of dense layers only tracks nothing but joins the collective (its layers' slots stay 0)
    values = (tracker["values"].detach().double().cpu().clone() if tracker is not None
              else torch.zeros(moe_layers.numel(), dtype=torch.float64))
    if dist.is_initialized():
        dist.all_reduce(values)
        # each CP rank's router holds its share's term (probabilities summed over its tokens / the whole
        # micro-batch's count, Megatron's switch_load_balancing_loss_func): the CP shares add up to the
        # micro-batch's loss (tests/workers/test_context_parallel.py), so CP is summed, DP averaged. TP keeps
        # its division as before (MoE training at TP > 1 needs sequence parallelism: not run on CPU)
        values /= ps.get_tensor_model_parallel_world_size() * ps.get_data_parallel_world_size()
    clear_aux_losses_tracker()
    per_mb = values / max(num_micro_batches, 1)
    if moe_layers is not None and moe_layers.numel() == per_mb.numel():  # a slot per layer; dense ones stay 0
        per_mb = per_mb[moe_layers]
    return {"moe/aux_loss": float(coef * per_mb.mean()), "moe/load_balancing_loss": float(per_mb.mean())}


@contextlib.contextmanager
def not_measured(probes: list[RouterProbe]):
    """Forwards inside the block replay as usual but leave the policy's routing statistics alone
    (the colocated reference runs in the actor's model: mrl/workers/reference.py)."""
    for p in probes:
        p.measure = False
    try:
        yield
    finally:
        for p in probes:
            p.measure = True


class RoutingRecord:
    """The routing every router used in the forwards run inside ``MegatronModel.recording_routing()``.

    Each probe keeps one ``[tokens, K]`` choice per forward of its layer (Megatron's s-major order of the
    micro-batch's rows); the model keeps the micro-batches it ran. :meth:`local` lays them out per sample as
    ``[b, S, layers, K]`` int32 aligned with the samples' ``input_ids`` (-1 where no token ran: padding,
    and the layers a model without a router there leaves dense), the layout of ``TrainBatch.routed_experts``.
    """

    def __init__(self, model: Any) -> None:  # a MegatronModel (which imports this module)
        self.model = model
        self.micro_batches: list[Any] = []  # MicroBatch
        self.per_layer: dict[int, list[torch.Tensor]] = {}

    def local(self, parts: list[list[int]] | None = None) -> torch.Tensor:
        """[b, S, layers, K] of this DP rank's samples: rows of micro-batch ``i`` are samples ``parts[i]`` (None:
        the micro-batches' samples in the order they ran). Collective over the pipeline (and, with sequence
        parallelism, the tensor-parallel) group: each stage records its own layers."""
        from mrl.workers.minibatch import restore_order

        per_mb = [self._micro_batch(i, mb) for i, mb in enumerate(self.micro_batches)]
        if parts is None:
            return torch.cat(per_mb, 0)
        return restore_order(per_mb, parts)

    def _micro_batch(self, i: int, mb: Any) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        from mrl.workers.minibatch import build_model_inputs, build_packed_inputs

        m = self.model
        inp = mb.inputs
        if inp.attention_mask is not None:
            raise ValueError("recording the routing of shared-prefix rows: one column serves several samples; "
                             "fix: actor.shared_prefix=false")
        b, S = mb.data.input_ids.shape
        layers, k = m.config.num_layers, m.config.moe_router_topk
        # Where each computed position comes from: the builder that made the rows maps sample i's column s to
        # it, so feed it the code i·S + s in the routed-experts slot (-1 where a position holds no token).
        codes = (torch.arange(b)[:, None] * S + torch.arange(S)[None, :])[:, :, None, None]
        build = build_packed_inputs if inp.cu_seqlens is not None else build_model_inputs
        cp = inp.cp_cols is not None  # context parallelism: each CP rank routed its zigzag share of the row
        kw = {"seq_multiple": 2 * m.cp_size * m.pad_to_multiple} if cp else {"pad_to_multiple": m.pad_to_multiple}
        where = build(mb.data.replace(routed_experts=codes), **kw).routed_experts
        where = where[..., 0, 0]  # [rows, L]
        rows, width = inp.tokens.shape[0], inp.full_length()  # as run (a pipeline pads every micro-batch to one length)
        sp = m.parallel.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1
        out = torch.full((b * S, layers, k), -1, dtype=torch.long)
        valid = where >= 0
        for layer, recs in self.per_layer.items():
            if len(recs) != len(self.micro_batches):
                raise RuntimeError(f"routing record: layer {layer} ran {len(recs)} forwards for "
                                   f"{len(self.micro_batches)} micro-batches (activation recompute runs the router "
                                   "again in the backward: record forward-only passes)")
            ids = recs[i]
            if sp:  # each TP rank routed a contiguous chunk of the sequence
                parts = [torch.empty_like(ids) for _ in range(ps.get_tensor_model_parallel_world_size())]
                dist.all_gather(parts, ids.contiguous(), group=m.tp_group)
                ids = torch.cat(parts, 0)
            if cp:  # every CP rank's share, put back in the row's column order (packed rows: one row)
                parts = [torch.empty_like(ids) for _ in range(m.cp_size)]
                dist.all_gather(parts, ids.contiguous(), group=m.cp_group)
                ids = torch.cat(parts, 0)[inp.cp_order.to(ids.device)]
            ids = ids.cpu().long().reshape(width, rows, k).transpose(0, 1)[:, : where.shape[1]]
            out[where[valid], layer] = ids[valid]
        if dist.get_world_size(m.pp_group) > 1:  # each stage filled its own layers; -1 + 1 = 0 elsewhere
            t = (out + 1).to(m.device)
            dist.all_reduce(t, group=m.pp_group)
            out = t.cpu() - 1
        return out.to(torch.int32).reshape(b, S, layers, k)
