"""Hugging Face ↔ Megatron-Core weight mapping for any TP/PP(/VPP) layout, table driven.

Each family's table is its ``weight_rules``, declared in its module (``mrl/families/<name>.py``)
from the building blocks of :mod:`mrl.families.rules`: a tuple of :class:`Rule`\\ s, each a Megatron
parameter name (relative to the ``GPTModel`` for model-level rules, to a ``TransformerLayer`` for
per-layer rules), the HF name(s) it is made of (``{i}`` is the *global* layer index) and how it
is split over TP:

``replicated``  same tensor on every TP rank (norms, q/k norms).
``column``      split along dim 0 (output features).
``row``         split along dim 1 (input features).
``vocab``       ``column`` after zero-padding rows ``[V, H] -> [V_pad, H]``; un-padded on export.
``qkv``         HF ``q [nh*d, H]``, ``k [ng*d, H]``, ``v [ng*d, H]`` → Megatron ``linear_qkv``
                ``[ng * (nh/ng + 2) * d, H]``, interleaved per query group
                ``[q_g0 (nh/ng heads), k_g0, v_g0, q_g1, ...]``, then split along dim 0 (each TP
                rank owns ``ng/TP`` whole groups). Biases ``[.]`` follow the same layout.
``qkv_gated``   as ``qkv`` with an output gate (Qwen3.5): HF ``q_proj [nh*2*d, H]`` holds ``[q_h | g_h]`` per head;
                Megatron's group is ``[q_g (nh/ng heads), gate_g (nh/ng heads), k_g, v_g]``.
``sections``    HF tensors made of row blocks (``Rule.sections``: Gated DeltaNet's ``in_proj_qkv = [q | k | v]``,
                ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, the conv1d channels): each block is split over TP on its
                own and rank r holds ``cat(block_0[r], block_1[r], ...)`` in the tensors' order.
``gdn_grouped`` Qwen3-Next's Gated DeltaNet input projection, stored per key-head group: ``in_proj_qkvz`` rows
                ``[q_g (d_k) | k_g (d_k) | v_g (r·d_v) | z_g (r·d_v)]`` and ``in_proj_ba`` rows ``[b_g (r) | a_g (r)]``
                for each key head g (``r`` value heads per key head) → the flat ``[q | k | v | z | b | a]`` of
                mrl's ``in_proj``, then as ``sections``.
``gate_up``     HF ``gate [F, H]``, ``up [F, H]`` → ``linear_fc1``; TP rank r holds
                ``cat(gate_r, up_r)`` with ``gate_r = gate.chunk(TP)[r]`` (SwiGLU's fused fc1).
``gate_up_interleaved``  one HF tensor in ``x @ W`` layout with gate and up columns alternating,
                ``W [H, 2F] = [g0, u0, g1, u1, ...]`` (a bias ``[2F]`` alike; gpt-oss) → ``gate = W[:, 0::2]ᵀ``,
                ``up = W[:, 1::2]ᵀ``, then as ``gate_up``.
``gate_up_t``   one HF tensor in ``x @ W`` layout, ``W [H, 2F] = [gate | up]`` (Qwen3-VL-MoE's released fused experts)
                → ``gate = W[:, :F]ᵀ``, ``up = W[:, F:]ᵀ``, then as ``gate_up``.
``row_t``       HF ``[F, H]`` in ``x @ W`` layout → Megatron ``[H, F]`` (transposed), split along dim 1.
                On load, ``gate_up_t`` and ``row_t`` also take the transposed tensor (``[2F, H]``, ``[H, F]``: what
                transformers 5's ``save_pretrained`` writes for Qwen3-VL-MoE), told apart by shape (``H != 2F``,
                ``H != F``; a square tensor is read as ``x @ W``); export writes ``x @ W``.

Spec namings: the local spec keeps ``input_layernorm``/``pre_mlp_layernorm``; the Transformer
Engine spec fuses them into ``linear_qkv.layer_norm_weight``/``linear_fc1.layer_norm_weight``
(:data:`TE_RENAMES`); the mapping resolves whichever the model has. Pipeline stages (and virtual
stages) hold consecutive layers; ``TransformerLayer.layer_number`` (1-based, global) gives the HF
index, so any PP/VPP layout maps without offset arithmetic here.

A model mixing dense and MoE layers (Qwen's ``mlp_only_layers`` / ``decoder_sparse_step``) gives each
global layer the rules of its kind (``Rule.layers``: ``moe`` rules on MoE layers, ``dense`` ones on the
others, by :meth:`mrl.families.Family.moe_layers`); a layer whose built MLP is not of that kind raises.

Fused experts (``Rule.fused``, gpt-oss): one HF tensor ``[E, ...]`` per layer holds every expert; load reads
it once per layer and gives expert ``e`` its slice ``[e]``; export stacks the local experts and gathers them
over EP into the whole tensor.

MoE layers (:mod:`mrl.megatron.moe`): the router is replicated; an *expert* rule names the local
expert ``{j}`` on the Megatron side and the global expert ``{e} = ep_rank · (E/EP) + j`` on the HF
side, and splits over the expert-tensor-parallel group (ETP) instead of TP. On load each EP rank
reads only its experts; on export the experts are gathered over the EP group too, so every rank
yields the whole layer (the weight sync and HF export then treat an MoE model like a dense one).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from mrl.families import FAMILIES, family_of
from mrl.families.rules import EMBED, LM_HEAD, SPLITS, Rule
from mrl.megatron.provider import head_dim
from mrl.megatron.unwrap import unwrap
from mrl.megatron.vision import vision_rules

_EMBED, _LM_HEAD = EMBED, LM_HEAD
_EXPERT_BIAS = "mlp.router.expert_bias"
# Each family's table, declared in its module (mrl/families/<name>.py, ``weight_rules``).
FAMILY_TABLES: dict[str, tuple[Rule, ...]] = {name: fam.weight_rules for name, fam in FAMILIES.items()}

TE_RENAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def _param(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """``name`` (or its TE name) in a module's ``dict(named_parameters())``: built once per module by the
    caller, since an MoE layer looks up two tensors per expert (every weight sync walks them all)."""
    if name in params:
        return params[name]
    alt = TE_RENAMES.get(name)
    return params.get(alt) if alt else None


def _tp(expert: bool = False) -> tuple[int, int, Any]:
    """(size, rank, group) of the tensor-parallel group that splits a rule: ETP for routed experts."""
    from megatron.core import parallel_state as ps

    if expert:
        return (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank(),
                ps.get_expert_tensor_parallel_group())
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()


def _ep() -> tuple[int, int, Any]:
    from megatron.core import parallel_state as ps

    return (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank(),
            ps.get_expert_model_parallel_group())


def _stage_params(chunks: list[torch.nn.Module], hf_config: Any) -> Iterator[tuple[Rule, dict[str, str], torch.Tensor]]:
    """(rule, format args, local Megatron parameter) for every mapped tensor of this rank."""
    family = family_of(hf_config)
    table = family.weight_rules_for(hf_config)  # the rules config.json gives this model (Rule.when, switches)
    moe_layers = family.moe_layers(hf_config)  # 1/0 per global layer: which rules a layer has
    linear_layers = family.linear_layers(hf_config)  # 1/0 per global layer: Gated DeltaNet or attention
    for chunk in map(unwrap, chunks):
        tied = chunk.share_embeddings_and_output_weights
        chunk_params = dict(chunk.named_parameters())
        for rule in table:
            if rule.scope != "model":
                continue
            p = _param(chunk_params, rule.mcore)
            if rule.mcore == _LM_HEAD.mcore and tied:
                continue  # exported as embed_tokens by the first stage; filled from it on load
            if p is not None:
                yield rule, {}, p
        for rule in vision_rules(chunk, hf_config):  # a vision-language model's tower (first stage, replicated)
            yield rule, {}, chunk_params[rule.mcore]
        for layer in chunk.decoder.layers:
            i = str(layer.layer_number - 1)
            # buffers too: the router's expert_bias (a score-correction bias, not trained) is a checkpoint tensor
            layer_params = {**dict(layer.named_buffers()), **dict(layer.named_parameters())}
            moe_layer = bool(moe_layers[layer.layer_number - 1])
            linear = bool(linear_layers[layer.layer_number - 1])
            for rule in table:
                if rule.scope != "layer" or not rule.on_layer(moe_layer, linear):
                    continue
                for fmt in _expert_fmts(layer, i) if rule.expert else ({"i": i},):
                    p = _param(layer_params, rule.mcore.format(**fmt))
                    if p is None:
                        raise KeyError(
                            f"Megatron layer {i} has no parameter {rule.mcore.format(**fmt)!r} (or its TE name); "
                            f"the {family.name} table (weight_rules in mrl/families/{family.name}.py) does not "
                            "match the layer spec"
                        )
                    yield rule, fmt, p


def _expert_fmts(layer: torch.nn.Module, i: str) -> list[dict[str, str]]:
    """Format args of each local expert of an MoE layer: layer ``i``, local ``j``, global ``e``."""
    n_local = layer.mlp.experts.num_local_experts
    _, ep_rank, _ = _ep()
    return [{"i": i, "j": str(j), "e": str(ep_rank * n_local + j), "n_local": str(n_local)}
            for j in range(n_local)]


def _all_experts(fmt: dict[str, str]) -> list[dict[str, str]]:
    """``fmt`` of a local expert -> the format args of the same local slot on every EP rank."""
    ep, _, _ = _ep()
    n_local, j = int(fmt["n_local"]), int(fmt["j"])
    return [{**fmt, "e": str(r * n_local + j)} for r in range(ep)]


def _hf_fmts(rule: Rule, fmt: dict[str, str]) -> list[dict[str, str]]:
    """Format args of the HF tensors one local parameter contributes to (a fused tensor: once per layer)."""
    if rule.fused:
        return [fmt] if fmt["j"] == "0" else []
    return _all_experts(fmt) if rule.expert else [fmt]


def hf_names_for_stage(model_chunks: list[torch.nn.Module], hf_config: Any) -> list[str]:
    """HF tensor names this rank's pipeline stage exports / needs to load (global layer ids)."""
    names = [hf.format(**f) for rule, fmt, _ in _stage_params(model_chunks, hf_config)
             for f in _hf_fmts(rule, fmt) for hf in rule.hf]
    for chunk in map(unwrap, model_chunks):
        # The last stage of a tied model keeps its own copy of the embedding as output_layer.
        if chunk.share_embeddings_and_output_weights and chunk.post_process and not chunk.pre_process:
            names.append(embed_name(hf_config))
    return names


def embed_name(hf_config: Any) -> str:
    """The HF name of the input embedding of this checkpoint (``model.embed_tokens.weight``, or under the decoder
    prefix of a vision-language checkpoint)."""
    return next(r.hf[0] for r in family_of(hf_config).weight_rules_for(hf_config) if r.mcore == _EMBED.mcore)


def _qkv_sizes(hf_config: Any) -> tuple[int, int, int]:
    nh = hf_config.num_attention_heads
    ng = getattr(hf_config, "num_key_value_heads", None) or nh
    return nh, ng, head_dim(hf_config)


def _merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hf_config: Any) -> torch.Tensor:
    nh, ng, d = _qkv_sizes(hf_config)
    rest = q.shape[1:]
    q = q.reshape(ng, nh // ng * d, *rest)
    k = k.reshape(ng, d, *rest)
    v = v.reshape(ng, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(ng * (nh // ng + 2) * d, *rest)


def _split_qkv(qkv: torch.Tensor, hf_config: Any) -> tuple[torch.Tensor, ...]:
    nh, ng, d = _qkv_sizes(hf_config)
    rest = qkv.shape[1:]
    g = qkv.reshape(ng, (nh // ng + 2) * d, *rest)
    q, k, v = torch.split(g, [nh // ng * d, d, d], dim=1)
    return q.reshape(nh * d, *rest), k.reshape(ng * d, *rest), v.reshape(ng * d, *rest)


def _merge_qkv_gated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hf_config: Any) -> torch.Tensor:
    nh, ng, d = _qkv_sizes(hf_config)
    rest = q.shape[1:]
    qg = q.reshape(ng, nh // ng, 2, d, *rest)  # per head [q_h | g_h]
    query, gate = qg[:, :, 0].reshape(ng, nh // ng * d, *rest), qg[:, :, 1].reshape(ng, nh // ng * d, *rest)
    return torch.cat([query, gate, k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], dim=1).reshape(-1, *rest)


def _split_qkv_gated(qkv: torch.Tensor, hf_config: Any) -> tuple[torch.Tensor, ...]:
    nh, ng, d = _qkv_sizes(hf_config)
    rest = qkv.shape[1:]
    g = qkv.reshape(ng, (2 * nh // ng + 2) * d, *rest)
    query, gate, k, v = torch.split(g, [nh // ng * d, nh // ng * d, d, d], dim=1)
    q = torch.stack([query.reshape(ng, nh // ng, d, *rest), gate.reshape(ng, nh // ng, d, *rest)], dim=2)
    return q.reshape(2 * nh * d, *rest), k.reshape(ng * d, *rest), v.reshape(ng * d, *rest)


def _section_sizes(rule: Rule, hf_config: Any) -> list[int]:
    return [w for blocks in rule.sections(hf_config) for w in blocks]  # type: ignore[misc]


def _shard_blocks(flat: torch.Tensor, sizes: list[int], tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of row blocks of ``sizes``: ``cat(block_0[rank], block_1[rank], ...)``."""
    return torch.cat([b.chunk(tp, dim=0)[rank] for b in flat.split(sizes)])


def _unshard_blocks(full: torch.Tensor, sizes: list[int], tp: int) -> list[torch.Tensor]:
    """Inverse of :func:`_shard_blocks` over all ranks: ``full`` = the TP ranks' shards concatenated
    (``[rank 0: b_0[0] | b_1[0] | ... | rank 1: b_0[1] | ...]``) -> the whole blocks ``b_0, b_1, ...``."""
    per_rank = [part.split([w // tp for w in sizes]) for part in full.chunk(tp, dim=0)]
    return [torch.cat([per_rank[r][b] for r in range(tp)]) for b in range(len(sizes))]


def _sections_to_local(rule: Rule, full: list[torch.Tensor], hf_config: Any, tp: int, rank: int) -> torch.Tensor:
    return _shard_blocks(torch.cat(full), _section_sizes(rule, hf_config), tp, rank)


def _sections_to_hf(rule: Rule, full: torch.Tensor, hf_config: Any, tp: int) -> list[torch.Tensor]:
    blocks = _unshard_blocks(full, _section_sizes(rule, hf_config), tp)
    tensors, at = [], 0
    for spec in rule.sections(hf_config):  # type: ignore[misc]
        tensors.append(torch.cat(blocks[at: at + len(spec)]).contiguous())
        at += len(spec)
    return tensors


def _gdn_dims(hf_config: Any) -> tuple[int, int, int, int]:
    nk, nv = int(hf_config.linear_num_key_heads), int(hf_config.linear_num_value_heads)
    return nk, nv // nk, int(hf_config.linear_key_head_dim), int(hf_config.linear_value_head_dim)


def _gdn_flat_sizes(hf_config: Any) -> list[int]:
    nk, r, dk, dv = _gdn_dims(hf_config)
    return [nk * dk, nk * dk, nk * r * dv, nk * r * dv, nk * r, nk * r]


def _gdn_ungroup(qkvz: torch.Tensor, ba: torch.Tensor, hf_config: Any) -> torch.Tensor:
    """Qwen3-Next's grouped ``in_proj_qkvz`` / ``in_proj_ba`` → the flat ``[q | k | v | z | b | a]`` rows."""
    nk, r, dk, dv = _gdn_dims(hf_config)
    rest = qkvz.shape[1:]
    q, k, v, z = qkvz.reshape(nk, 2 * dk + 2 * r * dv, *rest).split([dk, dk, r * dv, r * dv], dim=1)
    b, a = ba.reshape(nk, 2 * r, *rest).split([r, r], dim=1)
    return torch.cat([t.reshape(-1, *rest) for t in (q, k, v, z, b, a)])


def _gdn_group(flat: torch.Tensor, hf_config: Any) -> list[torch.Tensor]:
    nk = _gdn_dims(hf_config)[0]
    rest = flat.shape[1:]
    q, k, v, z, b, a = flat.split(_gdn_flat_sizes(hf_config))
    group = lambda *ts: torch.cat([t.reshape(nk, -1, *rest) for t in ts], dim=1).reshape(-1, *rest)
    return [group(q, k, v, z).contiguous(), group(b, a).contiguous()]


def _to_local(rule: Rule, full: list[torch.Tensor], hf_config: Any, local_shape: torch.Size) -> torch.Tensor:
    """The TP-local shard of ``rule`` given the full HF tensors (inverse of ``_to_hf``)."""
    tp, rank, _ = _tp(rule.expert)
    if rule.split == "replicated":
        return full[0]
    if rule.split == "column":
        return full[0].chunk(tp, dim=0)[rank]
    if rule.split == "row":
        return full[0].chunk(tp, dim=1)[rank]
    if rule.split == "vocab":
        w = full[0]
        pad = local_shape[0] * tp - w.shape[0]
        if pad < 0:
            raise ValueError(f"HF vocab {w.shape[0]} exceeds the padded Megatron vocab {local_shape[0] * tp}")
        w = torch.cat([w, w.new_zeros(pad, *w.shape[1:])]) if pad else w
        return w.chunk(tp, dim=0)[rank]
    if rule.split == "qkv":
        return _merge_qkv(*full, hf_config).chunk(tp, dim=0)[rank]
    if rule.split == "qkv_gated":
        return _merge_qkv_gated(*full, hf_config).chunk(tp, dim=0)[rank]
    if rule.split == "sections":
        return _sections_to_local(rule, full, hf_config, tp, rank)
    if rule.split == "gdn_grouped":
        return _shard_blocks(_gdn_ungroup(*full, hf_config), _gdn_flat_sizes(hf_config), tp, rank)
    if rule.split == "gate_up":
        return torch.cat([full[0].chunk(tp, dim=0)[rank], full[1].chunk(tp, dim=0)[rank]])
    if rule.split == "gate_up_interleaved":
        w = full[0]
        gate, up = w[..., 0::2], w[..., 1::2]
        if w.dim() == 2:  # x @ W layout -> Megatron's [out, in]
            gate, up = gate.t(), up.t()
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    if rule.split == "gate_up_t":
        w = full[0]
        if w.shape[0] != local_shape[1] and w.shape[-1] == local_shape[1]:  # transformers' [2F, H]
            w = w.t()
        gate, up = (t.t() for t in w.chunk(2, dim=1))
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    if rule.split == "row_t":
        w = full[0]
        if w.shape[-1] != local_shape[0] and w.shape[0] == local_shape[0]:  # already [H, F]
            return w.chunk(tp, dim=1)[rank]
        return w.t().chunk(tp, dim=1)[rank]
    raise ValueError(f"unknown split {rule.split!r}; expected one of {SPLITS}")


def _gather(local: torch.Tensor, dim: int, expert: bool = False) -> list[torch.Tensor]:
    tp, _, group = _tp(expert)
    if tp == 1:
        return [local]
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return parts


def _to_hf(rule: Rule, local: torch.Tensor, hf_config: Any) -> list[torch.Tensor]:
    """Full HF tensors of ``rule`` from this rank's shard (a TP collective for split rules)."""
    if rule.split == "replicated":
        return [local.detach().clone()]
    if rule.split == "row":
        return [torch.cat(_gather(local.detach(), 1, rule.expert), dim=1)]
    if rule.split == "row_t":
        return [torch.cat(_gather(local.detach(), 1, rule.expert), dim=1).t().contiguous()]
    full = torch.cat(_gather(local.detach(), 0, rule.expert), dim=0)
    if rule.split == "column":
        return [full]
    if rule.split == "vocab":
        return [full[: hf_config.vocab_size].clone()]
    if rule.split == "qkv":
        return [t.contiguous() for t in _split_qkv(full, hf_config)]
    if rule.split == "qkv_gated":
        return [t.contiguous() for t in _split_qkv_gated(full, hf_config)]
    if rule.split == "sections":
        return _sections_to_hf(rule, full, hf_config, _tp(rule.expert)[0])
    if rule.split == "gdn_grouped":
        return _gdn_group(torch.cat(_unshard_blocks(full, _gdn_flat_sizes(hf_config), _tp(rule.expert)[0])), hf_config)
    if rule.split in ("gate_up", "gate_up_interleaved", "gate_up_t"):
        halves = [p.chunk(2, dim=0) for p in full.chunk(_tp(rule.expert)[0], dim=0)]
        gate, up = torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
        if rule.split == "gate_up":
            return [gate, up]
        if rule.split == "gate_up_t":
            return [torch.cat([gate, up]).t().contiguous()]  # [H, 2F] = [gate | up]
        if gate.dim() == 2:
            gate, up = gate.t(), up.t()
        return [torch.stack([gate, up], dim=-1).reshape(*gate.shape[:-1], -1)]  # [g0, u0, g1, u1, ...]
    raise ValueError(f"unknown split {rule.split!r}; expected one of {SPLITS}")


def export_hf_weights(model_chunks: list[torch.nn.Module], hf_config: Any, *, only_lora: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for this rank's pipeline stage.

    Every rank of the TP group must iterate in lockstep (TP gathers are collectives); each PP
    stage yields its own layers under global HF indices. Tensors keep the parameter's dtype and
    device; the embedding / lm_head are un-padded to ``hf_config.vocab_size``; a tied model yields
    ``model.embed_tokens.weight`` (first stage) and no ``lm_head.weight``. A weight with LoRA
    adapters (:mod:`mrl.megatron.lora`) is exported merged, ``W + (alpha/r)·B·A``; ``only_lora``
    yields just the adapted HF projections (the only tensors that change while the base is frozen;
    e.g. ``q_proj``/``v_proj`` but not ``k_proj`` of a fused ``linear_qkv`` with q,v targets).
    """
    with torch.no_grad():
        fused: dict[str, list[list[torch.Tensor]]] = {}  # a fused rule's local experts, until the last one
        for rule, fmt, p in _stage_params(model_chunks, hf_config):
            adapter = getattr(p, "_lora_adapter", None)
            if adapter is not None:
                p = adapter.merged_weight(p)
            elif only_lora:
                continue
            if rule.fused:
                yield from _export_fused(rule, fmt, p, hf_config, fused)
                continue
            if rule.expert:
                yield from _export_expert(rule, fmt, p, hf_config)
                continue
            for name, tensor in zip(rule.hf, _to_hf(rule, p, hf_config)):
                if only_lora and name.split(".")[-2] not in adapter.A:
                    continue
                yield name.format(**fmt), tensor


def _export_expert(rule: Rule, fmt: dict[str, str], p: torch.Tensor, hf_config: Any
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Local expert slot ``j`` of every EP rank (ETP-gathered, then all-gathered over EP)."""
    ep, _, group = _ep()
    fmts = _all_experts(fmt)
    for name, tensor in zip(rule.hf, _to_hf(rule, p, hf_config)):
        if ep == 1:
            yield name.format(**fmts[0]), tensor
            continue
        parts = [torch.empty_like(tensor) for _ in range(ep)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        for f, part in zip(fmts, parts):
            yield name.format(**f), part


def _export_fused(rule: Rule, fmt: dict[str, str], p: torch.Tensor, hf_config: Any,
                  pending: dict[str, list[list[torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Collect local expert ``j``'s HF-layout tensors; after the last local expert, stack them, gather the
    stacks over EP (expert ``e = ep_rank · n_local + j``) and yield each fused ``[E, ...]`` tensor."""
    names = [n.format(**fmt) for n in rule.hf]
    parts = pending.setdefault(names[0], [[] for _ in names])
    for acc, tensor in zip(parts, _to_hf(rule, p, hf_config)):
        acc.append(tensor)
    if int(fmt["j"]) < int(fmt["n_local"]) - 1:
        return
    del pending[names[0]]
    ep, _, group = _ep()
    for name, acc in zip(names, parts):
        local = torch.stack(acc)
        if ep > 1:
            gathered = [torch.empty_like(local) for _ in range(ep)]
            dist.all_gather(gathered, local.contiguous(), group=group)
            local = torch.cat(gathered)
        yield name, local


def load_hf_weights(
    model_chunks: list[torch.nn.Module], hf_config: Any, get_tensor: Callable[[str], torch.Tensor]
) -> None:
    """Fill this rank's shards from full HF tensors: ``get_tensor(hf_name) -> [full shape]``.

    Shapes are checked against the config (a mismatch names the tensor); padded vocab rows are
    zero. Tied models also copy ``model.embed_tokens.weight`` into a separate last-stage
    ``output_layer`` (pipeline parallel), as Megatron keeps one copy per end of the pipeline.
    """
    with torch.no_grad():
        fused: dict[str, torch.Tensor] = {}  # one layer's fused expert tensors, read once for its local experts
        fused_layer = None
        for rule, fmt, p in _stage_params(model_chunks, hf_config):
            names = [n.format(**fmt) for n in rule.hf]  # a routed expert: this rank's global e
            if rule.fused:
                if fused_layer != fmt["i"]:
                    fused, fused_layer = {}, fmt["i"]
                for n in names:
                    if n not in fused:
                        fused[n] = get_tensor(n)
                full = [fused[n][int(fmt["e"])] for n in names]
            else:
                full = [get_tensor(n) for n in names]
            local = _to_local(rule, full, hf_config, p.shape)
            if local.shape != p.shape:
                raise ValueError(
                    f"HF tensor(s) {names} with shapes {[tuple(t.shape) for t in full]} give a shard "
                    f"of shape {tuple(local.shape)} but Megatron {rule.mcore!r} is {tuple(p.shape)}: "
                    "config.json does not match the weights"
                )
            if rule.mcore == _EXPERT_BIAS and p.dtype != torch.float32:
                # Megatron keeps the router's score-correction bias in fp32 in a bf16 model (its router restores
                # the dtype on the next forward, after Float16Module's cast): load it unrounded
                p.data = p.data.to(torch.float32)
            p.copy_(local)
        for chunk in map(unwrap, model_chunks):
            if chunk.share_embeddings_and_output_weights and chunk.post_process and not chunk.pre_process:
                w = chunk.output_layer.weight
                w.copy_(_to_local(_EMBED, [get_tensor(embed_name(hf_config))], hf_config, w.shape))
