"""LoRA adapters on Megatron-Core's tensor-parallel linears, laid out so HF ``peft`` maps exactly.

For a frozen projection ``y = x Wᵀ`` (HF ``W ∈ R^{out × in}``) the adapter adds
``Δy = s · dropout(x) Aᵀ Bᵀ`` with ``A ∈ R^{r × in}``, ``B ∈ R^{out × r}``, ``s = alpha / r``
(peft's ``lora_A``/``lora_B``/``scaling``). Over ``T`` tensor-parallel ranks (rank ``t``):

* **column-parallel** (``linear_qkv``, ``linear_fc1``; ``W`` split by rows, ``W_t = W[t·out/T:(t+1)·out/T]``):
  ``A`` replicated, ``B_t`` = the same row block of ``B``. ``u = x Aᵀ`` is identical on every rank;
  ``Δy_t = s · u B_tᵀ`` is the rank's slice of the output. Backward: the gradient of ``u`` is a
  partial sum per rank, so ``u`` passes Megatron's ``copy_to_tensor_model_parallel_region``
  (identity forward, all-reduce backward) and ``∂A`` comes out whole and equal on every rank.
* **row-parallel** (``linear_proj``, ``linear_fc2``; ``W`` split by columns, the input arrives split):
  ``A_t = A[:, t·in/T:(t+1)·in/T]``, ``B`` replicated. ``u = Σ_t x_t A_tᵀ`` is formed by
  ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward), then
  ``Δy = s · u Bᵀ`` is added to the (already all-reduced) base output.

Fused projections keep one adapter per HF projection (so ``q_proj``, ``k_proj``, ``v_proj`` each
have their own rank-``r`` ``A``/``B``, exactly as peft on the HF model): their per-rank outputs are
placed in the fused layout of :mod:`mrl.megatron.mapping` — ``linear_qkv`` interleaved per query
group ``[q_g (nh/ng heads), k_g, v_g]`` over this rank's ``ng/T`` groups, ``linear_fc1`` as
``[gate_t, up_t]``. A projection that is not targeted contributes zero. Pipeline stages only see
their own layers; ``layer_number`` gives the global HF index.

Mixture-of-Experts models: a layer gets adapters on the linears it has — attention always, ``mlp.linear_fc*`` on a
dense layer, ``mlp.shared_experts.linear_fc*`` (HF ``mlp.shared_expert.*``, width
``shared_expert_intermediate_size``; GLM-4.5's ``mlp.shared_experts.*`` of ``n_shared_experts · moe_intermediate_size``:
the family's rule and width) on an MoE layer with a shared expert; the routed experts and the router stay
frozen (docs/lora.md).

Hybrid decoders (Qwen3.5 / Qwen3.6, Qwen3-Next; :mod:`mrl.megatron.gated_delta_net`): a gated full-attention
layer's ``q_proj`` is ``[2·nh·d, H]``, ``[q_h | g_h]`` per head (the output gate); its ``B`` splits over TP by whole
heads like the weight, and the adapter's per-rank output is de-interleaved into Megatron's per-group
``[q_g, gate_g, k_g, v_g]`` (the ``qkv_gated`` split of :mod:`mrl.megatron.mapping`). A Gated DeltaNet layer's
column-parallel ``in_proj`` fuses HF ``linear_attn.in_proj_qkv`` (rows ``[q | k | v]``), ``in_proj_z``,
``in_proj_b``, ``in_proj_a`` as ``[q_t | k_t | v_t | z_t | b_t | a_t]`` on rank t (key and value heads split over
TP): ``in_proj_qkv``'s ``B`` is split block by block (rank t holds ``B_q[t] | B_k[t] | B_v[t]``), the others by
contiguous chunks. Qwen3-Next stores the same rows grouped per key head (``in_proj_qkvz``: ``[q_g k_g v_g z_g]``,
``in_proj_ba``: ``[b_g a_g]``): a rank's key heads are a contiguous chunk of those groups, and its output is
regrouped into the flat layout. ``linear_attn.out_proj`` is row-parallel over the value heads. The conv1d, ``A_log``,
``dt_bias`` and the gated norm get no adapters (not linears; peft leaves them too). A vision-language release keeps
the decoder under ``model.language_model.``: peft's names carry that prefix (:func:`peft_name`).

The adapters are sibling modules of the linear (``self_attention.linear_qkv_lora``), applied by a
forward hook on the linear, so the base parameter names, the HF mapping and Megatron's checkpoint
keys of the base model are unchanged; their ``sharded_state_dict`` stores global ``A``/``B``
tensors (layout independent, like the weights). The base weights are frozen (``requires_grad``
off before DDP wraps the model: no gradient buffer, no optimizer state).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from mrl.megatron.lora_names import (  # noqa: F401  (adapted_targets: re-exported)
    GDN_GROUPED,
    GDN_MODULE,
    HF_MODULE,
    LINEARS,
    adapted_targets,
    decoder_hf_prefix,
    gdn_widths,
    linear_projs,
    peft_name,
    proj_shapes,
    shared_expert_hf,
    shared_expert_width,
)
from mrl.megatron.provider import head_dim
from mrl.megatron.unwrap import unwrap


def _tp() -> tuple[int, int, Any]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()


class LoraAdapter(torch.nn.Module):
    """The adapters of one Megatron parallel linear on this rank (see the module docstring).

    ``A[proj]``/``B[proj]`` hold this rank's shards: column ``A [r, in]``, ``B [out/T, r]``;
    row ``A [r, in/T]``, ``B [out, r]``.
    """

    def __init__(self, linear: str, targets: tuple[str, ...], *, hf_config: Any, layer: int, rank: int,
                 alpha: float, dropout: float, dtype: torch.dtype, device: torch.device, seed: int) -> None:
        from megatron.core.tensor_parallel.layers import (
            set_tensor_model_parallel_attributes,
        )

        from mrl.families import family_of

        super().__init__()
        self.kind = LINEARS[linear][0]
        self.projs = linear_projs(linear, hf_config)
        self.linear = linear
        self.layer = layer
        self.rank, self.scaling = rank, alpha / rank
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.enabled = True
        tp, tp_rank, _ = _tp()
        self.tp, self.tp_rank = tp, tp_rank
        nh = hf_config.num_attention_heads
        self.ng_local = (getattr(hf_config, "num_key_value_heads", None) or nh) // tp
        self.heads_per_group = nh // (self.ng_local * tp)
        self.d = head_dim(hf_config)
        self.gated_q = bool(family_of(hf_config).attention_output_gate)  # q_proj = [q_h | g_h] per head
        self.gdn = gdn_widths(hf_config) if linear == "self_attention.in_proj" else {}
        shared = linear.startswith("mlp.shared_experts.")
        self.shared_hf = shared_expert_hf(hf_config)  # the family's HF module of the shared expert (peft names)
        self.decoder = decoder_hf_prefix(hf_config)  # peft names: model.layers. or model.language_model.layers.
        shapes = proj_shapes(hf_config, shared_expert_width(hf_config) if shared else None)
        self.out_local = {p: shapes[p][0] // tp if self.kind == "column" else shapes[p][0] for p in self.projs}
        self.A = torch.nn.ParameterDict()
        self.B = torch.nn.ParameterDict()
        for proj in (p for p in self.projs if p in targets):
            out, inp = shapes[proj]
            # Full A drawn from a generator keyed by (seed, layer, projection), then sliced: every TP
            # layout starts from the same adapters. peft's init: A Kaiming-uniform(a=√5), B = 0.
            if proj in HF_MODULE:
                key = (seed * 1009 + layer) * len(HF_MODULE) + list(HF_MODULE).index(proj)
            else:  # the Gated DeltaNet projections: keys of their own (never another layer's q_proj key)
                key = 2**40 + (seed * 1009 + layer) * len(GDN_MODULE) + list(GDN_MODULE).index(proj)
            g = torch.Generator().manual_seed(key)
            a_full = torch.empty(rank, inp)
            torch.nn.init.kaiming_uniform_(a_full, a=math.sqrt(5), generator=g)
            if self.kind == "column":
                a, b = a_full, torch.zeros(out // tp, rank)
            else:
                a, b = a_full.chunk(tp, dim=1)[tp_rank].clone(), torch.zeros(out, rank)
            self.A[proj] = torch.nn.Parameter(a.to(device=device, dtype=dtype))
            self.B[proj] = torch.nn.Parameter(b.to(device=device, dtype=dtype))
            split = self.B[proj] if self.kind == "column" else self.A[proj]
            set_tensor_model_parallel_attributes(split, True, 0 if self.kind == "column" else 1, 1)

    # ---- TP split of a column linear's B rows --------------------------------------------------
    def _row_blocks(self, proj: str) -> list[int] | None:
        """Row blocks of HF ``proj`` that TP splits one by one (Qwen3.5's ``in_proj_qkv = [q | k | v]``: rank t holds
        ``q_t | k_t | v_t``, as the weight's ``sections`` split); None: one contiguous chunk per rank (every other
        projection: heads, groups or features in rank order — the gated ``q_proj``'s heads and Qwen3-Next's key-head
        groups included)."""
        if proj != "in_proj_qkv":
            return None
        w = self.gdn
        return [w["nk"] * w["dk"], w["nk"] * w["dk"], w["nk"] * w["r"] * w["dv"]]

    def local_rows(self, proj: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full ``[out, .]`` tensor of column projection ``proj``."""
        from mrl.megatron.mapping import _shard_blocks

        blocks = self._row_blocks(proj)
        if blocks is None:
            return full.chunk(self.tp, dim=0)[self.tp_rank]
        return _shard_blocks(full, blocks, self.tp, self.tp_rank)

    def full_rows(self, proj: str, gathered: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`local_rows` over the TP ranks (``gathered``: their shards concatenated in rank order)."""
        from mrl.megatron.mapping import _unshard_blocks

        blocks = self._row_blocks(proj)
        return gathered if blocks is None else torch.cat(_unshard_blocks(gathered, blocks, self.tp))

    # ---- layout of the fused outputs ---------------------------------------------------------
    def _fuse(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Per-projection local outputs ``[..., out_p/T]`` → the linear's local layout (last dim).

        ``linear_qkv``: per local query group ``[q_g, k_g, v_g]``, with an output gate ``[q_g, gate_g, k_g, v_g]``
        (the gated ``q_proj``'s ``[q_h | g_h]`` per head de-interleaved). Qwen3-Next's ``in_proj``: its grouped
        ``[q_g k_g v_g z_g]`` / ``[b_g a_g]`` rows (this rank's key heads) → ``[q | k | v | z | b | a]``."""
        if self.linear == "self_attention.linear_qkv":
            q, k, v = parts
            lead = q.shape[:-1]
            g, hpg, d = self.ng_local, self.heads_per_group, self.d
            if self.gated_q:
                qg = q.reshape(*lead, g, hpg, 2, d)
                q = torch.cat([qg[..., 0, :].reshape(*lead, g, hpg * d), qg[..., 1, :].reshape(*lead, g, hpg * d)], -1)
            else:
                q = q.reshape(*lead, g, hpg * d)
            k, v = k.reshape(*lead, g, d), v.reshape(*lead, g, d)
            return torch.cat([q, k, v], dim=-1).reshape(*lead, -1)
        if self.projs == GDN_GROUPED:
            w, qkvz, ba = self.gdn, *parts
            lead, nk = qkvz.shape[:-1], w["nk"] // self.tp
            flat = [*qkvz.reshape(*lead, nk, -1).split([w["dk"], w["dk"], w["r"] * w["dv"], w["r"] * w["dv"]], -1),
                    *ba.reshape(*lead, nk, -1).split([w["r"], w["r"]], -1)]
            return torch.cat([t.reshape(*lead, -1) for t in flat], dim=-1)
        return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``s · dropout(x) Aᵀ Bᵀ`` in this rank's output layout (the linear's output shape)."""
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        if self.kind == "row" and self.training and isinstance(self.dropout, torch.nn.Dropout):
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            # x_t is this rank's slice of the features: Megatron's model-parallel RNG (a different
            # stream per TP rank) keeps the slices' masks independent, as one mask over all of x.
            with get_cuda_rng_tracker().fork():
                xd = self.dropout(x)
        else:
            # Column layers see the same x on every TP rank and must draw the same mask: the default
            # generator, seeded alike on the ranks of a TP group (mrl.megatron.parallel.init_parallel).
            xd = self.dropout(x)
        parts = []
        for proj in self.projs:
            if proj not in self.A:
                parts.append(x.new_zeros(*x.shape[:-1], self.out_local[proj]))
                continue
            u = F.linear(xd, self.A[proj])
            if self.kind == "column":
                u = copy_to_tensor_model_parallel_region(u)
            else:
                u = reduce_from_tensor_model_parallel_region(u)
            parts.append(F.linear(u, self.B[proj]) * self.scaling)
        return self._fuse(parts)

    def hook(self, _module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Forward hook on the base linear: add the adapter output (its ``(out, bias)`` kept)."""
        if not self.enabled:
            return output
        out, *rest = output if isinstance(output, tuple) else (output,)
        x = args[0] if args else kwargs["input_"]  # Megatron's linears name their input ``input_``
        out = out + self.delta(x).to(out.dtype)
        return (out, *rest) if isinstance(output, tuple) else out

    @torch.no_grad()
    def merged_weight(self, w_local: torch.Tensor) -> torch.Tensor:
        """``W_t + s · (B A)_t`` in this rank's layout (no collective: ``B·A`` is local per shard)."""
        parts = []
        for proj in self.projs:
            if proj not in self.A:
                parts.append(w_local.new_zeros(self.out_local[proj], w_local.shape[1]).T)
                continue
            parts.append((self.scaling * (self.B[proj].float() @ self.A[proj].float())).T)
        return (w_local.float() + self._fuse(parts).T).to(w_local.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Global ``A``/``B`` tensors (TP shards as slices, layers stacked by the caller's offsets)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        sd = self.state_dict(prefix="", keep_vars=True)
        split = "B" if self.kind == "column" else "A"
        axis = {k: (0 if self.kind == "column" else 1) for k in sd if k.startswith(split + ".")}
        out = make_sharded_tensors_for_checkpoint(sd, prefix, axis, sharded_offsets)
        for proj in self.B:
            blocks = self._row_blocks(proj) if self.kind == "column" else None
            if blocks is not None:
                # a rank's B rows interleave row blocks (q_t | k_t | v_t): stored as the named blocks, each split over
                # TP on its own, so a checkpoint saved at one TP loads at another (as GatedDeltaNet's in_proj)
                from megatron.core.ssm.gated_delta_net import _split_tensor_factory

                key = f"{prefix}B.{proj}"
                out[key] = _split_tensor_factory(out[key], [w // self.tp for w in blocks], ["query", "key", "value"], 0)
        return out


def _has(layer: torch.nn.Module, path: str) -> bool:
    """The layer has this linear: an MoE layer has no ``mlp.linear_fc1``, a dense one no shared expert."""
    try:
        return layer.get_submodule(path) is not None
    except AttributeError:
        return False


def _resolve(layer: torch.nn.Module, path: str) -> tuple[torch.nn.Module, str]:
    parent_path, _, name = path.rpartition(".")
    return layer.get_submodule(parent_path), name


def apply_lora(chunks: list[torch.nn.Module], hf_config: Any, *, targets: tuple[str, ...], rank: int, alpha: float,
               dropout: float, seed: int) -> list[LoraAdapter]:
    """Freeze every parameter of ``chunks`` and add adapters on the layers' target linears.

    Call before DDP wraps the chunks (DDP and the optimizer only see ``requires_grad`` params).
    Linears must be Megatron's local-spec layers (the Transformer Engine spec fuses the input
    norm into ``linear_qkv``/``linear_fc1``, which hides the adapter's input).
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
    )

    from mrl.families import family_of

    if family_of(hf_config).is_mla:
        raise ValueError("LoRA on a multi-latent-attention model (DeepSeek-V3): the adapters wrap q/k/v/o and MLP "
                         "projections, not MLA's latent projections; fix: actor.lora.rank=0")
    adapters = []
    for chunk in map(unwrap, chunks):
        chunk.requires_grad_(False)
        for layer in chunk.decoder.layers:
            for path, (kind, _) in LINEARS.items():
                chosen = tuple(p for p in linear_projs(path, hf_config) if p in targets)
                if not chosen or not _has(layer, path):
                    continue
                parent, name = _resolve(layer, path)
                linear = getattr(parent, name)
                want = ColumnParallelLinear if kind == "column" else RowParallelLinear
                if not isinstance(linear, want):
                    raise TypeError(
                        f"LoRA needs Megatron's local {want.__name__} at layer {layer.layer_number - 1} {path}, got "
                        f"{type(linear).__name__} (the Transformer Engine spec fuses the input norm); build the model "
                        "with the local spec (MegatronModel does this when actor.lora.rank > 0)"
                    )
                w = linear.weight
                ad = LoraAdapter(path, chosen, hf_config=hf_config, layer=layer.layer_number - 1, rank=rank,
                                 alpha=alpha, dropout=dropout, dtype=w.dtype, device=w.device, seed=seed)
                parent.add_module(name + "_lora", ad)
                linear.register_forward_hook(ad.hook, with_kwargs=True)
                w._lora_adapter = ad  # the HF export merges through it (mapping.export_hf_weights)
                adapters.append(ad)
    return adapters


def adapters_of(chunks: list[torch.nn.Module]) -> list[LoraAdapter]:
    return [m for c in chunks for m in c.modules() if isinstance(m, LoraAdapter)]


@contextlib.contextmanager
def adapters_disabled(chunks: list[torch.nn.Module]) -> Iterator[None]:
    """The base model inside the block (the LoRA reference policy); adapters back on after."""
    ads = adapters_of(chunks)
    for a in ads:
        a.enabled = False
    try:
        yield
    finally:
        for a in ads:
            a.enabled = True


def export_peft_tensors(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(peft name, full tensor)`` of this rank's stage; TP-gathered (all TP ranks iterate in lockstep)."""
    import torch.distributed as dist

    tp, _, group = _tp()

    def gather(t: torch.Tensor, dim: int) -> torch.Tensor:
        if tp == 1:
            return t.detach().clone()
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.detach().contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    for ad in adapters_of(chunks):
        for proj in ad.A:
            a, b = ad.A[proj], ad.B[proj]
            a = gather(a, 1) if ad.kind == "row" else a.detach().clone()
            b = ad.full_rows(proj, gather(b, 0)) if ad.kind == "column" else b.detach().clone()
            yield peft_name(ad.layer, proj, "A", ad.linear, ad.shared_hf, ad.decoder), a
            yield peft_name(ad.layer, proj, "B", ad.linear, ad.shared_hf, ad.decoder), b


@torch.no_grad()
def load_peft_tensors(chunks: list[torch.nn.Module], get: Callable[[str], torch.Tensor]) -> None:
    """Fill this rank's adapter shards from full peft tensors (``get(peft name)``); shapes checked."""
    tp, tp_rank, _ = _tp()
    for ad in adapters_of(chunks):
        for proj in ad.A:
            for which, param in (("A", ad.A[proj]), ("B", ad.B[proj])):
                name = peft_name(ad.layer, proj, which, ad.linear, ad.shared_hf, ad.decoder)
                full = get(name)
                if ad.kind == "column":
                    local = ad.local_rows(proj, full) if which == "B" else full
                else:
                    local = full.chunk(tp, dim=1)[tp_rank] if which == "A" else full
                if local.shape != param.shape:
                    raise ValueError(f"adapter tensor {name} of shape {tuple(full.shape)} does not fit "
                                     f"{tuple(param.shape)} on TP rank {tp_rank}/{tp}: another rank or model?")
                param.copy_(local)


def peft_adapter_config(base_model: str, *, rank: int, alpha: float, dropout: float, targets: tuple[str, ...]) -> dict:
    """``adapter_config.json`` that ``peft.PeftModel.from_pretrained`` reads."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": rank,
            "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": list(targets), "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False, "init_lora_weights": True}
