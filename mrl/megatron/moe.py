"""Mixture-of-Experts families: HF ``config.json`` → Megatron-Core MoE settings.

Each family declares its router and experts in its module (:class:`mrl.families.MoE` in
``mrl/families/{qwen3_moe,qwen2_moe,mixtral,gpt_oss}.py``); this module answers by family key for the
trainer and holds the Megatron import fix. Supported (dropless top-k routing, SwiGLU experts; every
decoder layer an MoE layer, or, where Qwen's ``decoder_sparse_step`` / ``mlp_only_layers`` say so, some of
them dense SwiGLU MLPs of ``intermediate_size``: Megatron's ``moe_layer_freq`` list, ``MoE.layers``)::

    family      architectures          router                                 extras
    qwen3_moe   Qwen3MoeForCausalLM    softmax → top-k, renorm if norm_topk   q/k RMSNorm
    qwen2_moe   Qwen2MoeForCausalLM    softmax → top-k, renorm if norm_topk   qkv bias, shared expert
                                                                              with a sigmoid gate
    mixtral     MixtralForCausalLM     softmax → top-k → renorm (always)
    gpt_oss     GptOssForCausalLM      top-k of biased logits → softmax      sinks, windows, biases,
                                                                              clamped SwiGLU (gpt_oss.py)
    deepseek_v3 DeepseekV3ForCausalLM  sigmoid (+bias) → group top-k → renorm  MLA, ungated shared
                                       × routed_scaling_factor                 experts, dense first layers
    glm4_moe    Glm4MoeForCausalLM     sigmoid + frozen bias → top-k          partial RoPE, qkv bias / q/k
                                       (→ groups) → renorm × scaling          norm per config, ungated
                                                                              shared expert, dense first layers

One MoE layer (``x`` the pre-MLP-normed hidden state of one token, ``E`` experts, top-``k``)::

    p = softmax(W_router x)                           [E]
    S = topk_indices(p, k)                            (the routed experts)
    w_e = p_e / sum_{j in S} p_j  (norm_topk)   or   w_e = p_e  (not normalised)
    y = sum_{e in S} w_e · down_e(silu(gate_e x) * up_e x)  [+ sigmoid(g·x) · shared(x)]

Megatron computes the normalised variant as ``softmax`` over the top-k *logits* (identical maths:
the softmax denominator cancels) and the un-normalised one with ``moe_router_pre_softmax``. The
load-balancing loss is Switch's ``coef · E · sum_e f_e · P_e`` (``f_e`` the fraction of routed
tokens, ``P_e`` the mean router probability), coefficient ``router_aux_loss_coef``; Megatron adds
its gradient in the backward of the router (``MoEAuxLossAutoScaler``) and tracks its value.

Expert parallelism: expert ``e`` lives on EP rank ``e // (E / EP)`` as ``local_experts.{e % (E/EP)}``;
inside an expert, the expert-tensor-parallel group (ETP) splits fc1 by columns and fc2 by rows
like TP does for a dense MLP. DeepSeek-V3 (``mrl/families/deepseek_v3.py``) declares a sigmoid router with a
score-correction bias, group-limited top-k and routed scaling through the same :class:`mrl.families.MoE`
fields (their maths: :class:`mrl.families.base.MoE`; docs/moe.md).
"""
from __future__ import annotations

from typing import Any

from mrl.families import FAMILIES
from mrl.families.base import num_experts, router_topk  # noqa: F401  (re-exported)


def is_moe_family(family: str) -> bool:
    return FAMILIES[family].is_moe if family in FAMILIES else False


def check_moe_supported(hf_config: Any, family: str) -> None:
    """Refuse what Megatron's local MoE layer would compute differently from transformers."""
    FAMILIES[family].moe.check(hf_config)


def moe_transformer_kwargs(hf_config: Any, family: str, *, ep: int, etp: int) -> dict[str, Any]:
    """``TransformerConfig`` keywords of the MoE layer for ``hf_config`` (dropless, no grouped GEMM
    on the local spec; callers may override the dispatcher, the aux-loss coefficient and replay)."""
    return FAMILIES[family].moe.transformer_kwargs(hf_config, ep=ep, etp=etp)


def ensure_megatron_moe_importable() -> None:
    """megatron-core 0.16.1's ``moe_utils`` names ``te_general_gemm`` in the router's GEMM without
    defining it when Transformer Engine is absent (a ``NameError`` on CPU and on CUDA hosts without
    TE); ``None`` selects its plain ``torch.mm`` branch, the one its own code means for that case."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _fix_expert_bias_padding_mask()


def _fix_expert_bias_padding_mask() -> None:
    """megatron-core 0.16.1's ``TopKRouter._apply_expert_bias`` masks the [tokens, experts] routing map with the
    [tokens] padding mask without a trailing axis, which fails to broadcast (unless tokens == experts), so a
    router with an expert bias (DeepSeek-V3, GLM-4.5) crashes in training whenever a padding mask is passed
    (mrl passes one for every MoE model: padding stays out of the aux losses). The replacement does what the
    rest of the router does with that mask (``compute_routing_scores_for_aux_loss``): True = padding, left out
    of the tokens counted per expert for the bias update."""
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    if getattr(TopKRouter._apply_expert_bias, "mrl_fixed", False):
        return

    def _apply_expert_bias(self: Any, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.unsqueeze(-1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    _apply_expert_bias.mrl_fixed = True  # type: ignore[attr-defined]
    TopKRouter._apply_expert_bias = _apply_expert_bias


def expert_row_parallel_linear() -> type:
    """Megatron's ``RowParallelLinear`` for the experts' ``linear_fc2`` of a model whose experts have biases
    (gpt-oss), on the local spec.

    megatron-core 0.16.1's expert MLP adds its bias in place (``output += output_bias · probs``). At EP1 with
    ETP1 the fc2 output comes out of ``reduce_from_tensor_model_parallel_region`` over a group of one, which
    returns its input as a view of a custom autograd function, and autograd forbids the in-place add: the
    backward of a training step raises. An expert's fc2 never needs that reduce (with ETP > 1 or EP > 1 Megatron
    already skips it: ``explicit_expert_comm``; with ETP1 it is the identity), so this class skips it always."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    class ExpertRowParallelLinear(RowParallelLinear):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.is_expert:  # ETP1: the reduce over the expert-TP group is the identity
                self.explicit_expert_comm = True

    return ExpertRowParallelLinear
