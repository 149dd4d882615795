"""Mixture-of-Experts families: HF ``config.json`` → Megatron-Core MoE settings.

Supported (every decoder layer is an MoE layer, dropless top-k routing, SwiGLU experts)::

    family      architectures          router                                 extras
    qwen3_moe   Qwen3MoeForCausalLM    softmax → top-k, renorm if norm_topk   q/k RMSNorm
    qwen2_moe   Qwen2MoeForCausalLM    softmax → top-k, renorm if norm_topk   qkv bias, shared expert
                                                                              with a sigmoid gate
    mixtral     MixtralForCausalLM     softmax → top-k → renorm (always)

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
like TP does for a dense MLP. DeepSeek-V3-style models (multi-latent attention, sigmoid router
with a score-correction bias, group-limited top-k, dense first layers) are refused with the reason:
mrl's HF table has no MLA mapping and its tests have no transformers parity for them yet.
"""
from __future__ import annotations

from typing import Any

MOE_ARCHITECTURES: dict[str, str] = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
}
MOE_FAMILIES = frozenset(MOE_ARCHITECTURES.values())

# Architectures users bring that mrl recognises as MoE but cannot build yet, and why.
REFUSED_MOE: dict[str, str] = {
    "DeepseekV3ForCausalLM": (
        "DeepSeek-V3 needs multi-latent attention, a sigmoid router with a score-correction bias, "
        "group-limited top-k and dense first layers; mrl's HF<->Megatron table has no MLA mapping "
        "and no transformers parity test for it yet"
    ),
    "DeepseekV2ForCausalLM": "DeepSeek-V2 needs multi-latent attention, which mrl does not map yet",
    "GptOssForCausalLM": "gpt-oss needs attention sinks, biased experts and a clamped SwiGLU, which "
                         "Megatron's local spec does not implement",
}


def is_moe_family(family: str) -> bool:
    return family in MOE_FAMILIES


def num_experts(hf_config: Any) -> int:
    n = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    if not n:
        raise ValueError("config.json of an MoE model has no num_experts / num_local_experts")
    return int(n)


def router_topk(hf_config: Any) -> int:
    return int(hf_config.num_experts_per_tok)


def expert_ffn_size(hf_config: Any, family: str) -> int:
    """Hidden size of one routed expert's MLP (Mixtral keeps it in ``intermediate_size``)."""
    if family == "mixtral":
        return int(hf_config.intermediate_size)
    return int(hf_config.moe_intermediate_size)


def norm_topk_prob(hf_config: Any, family: str) -> bool:
    return True if family == "mixtral" else bool(getattr(hf_config, "norm_topk_prob", False))


def shared_expert_size(hf_config: Any, family: str) -> int:
    """0 unless the family has a shared expert (Qwen2-MoE)."""
    if family != "qwen2_moe":
        return 0
    return int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)


def check_moe_supported(hf_config: Any, family: str) -> None:
    """Refuse what Megatron's local MoE layer would compute differently from transformers."""
    e, k = num_experts(hf_config), router_topk(hf_config)
    if not 1 <= k <= e:
        raise ValueError(f"config.json num_experts_per_tok={k} must be in [1, num_experts={e}]")
    if family in ("qwen3_moe", "qwen2_moe"):
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        dense = list(getattr(hf_config, "mlp_only_layers", None) or [])
        if step != 1 or dense:
            raise ValueError(
                f"config.json decoder_sparse_step={step}, mlp_only_layers={dense}: mrl builds every layer "
                "as an MoE layer; models mixing dense and MoE layers are not supported yet (set "
                "decoder_sparse_step=1 and mlp_only_layers=[] if the checkpoint really is all-MoE)"
            )
    if family == "mixtral" and float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0) != 0.0:
        raise ValueError(
            "config.json router_jitter_noise != 0: random router noise makes the trainer's routing differ "
            "from the engine's; set it to 0.0"
        )


def moe_transformer_kwargs(hf_config: Any, family: str, *, ep: int, etp: int) -> dict[str, Any]:
    """``TransformerConfig`` keywords of the MoE layer for ``hf_config`` (dropless, no grouped GEMM
    on the local spec; callers may override the dispatcher, the aux-loss coefficient and replay)."""
    e = num_experts(hf_config)
    if e % ep:
        raise ValueError(f"num_experts={e} is not divisible by expert_model_parallel_size={ep}")
    kw: dict[str, Any] = {
        "num_moe_experts": e,
        "moe_ffn_hidden_size": expert_ffn_size(hf_config, family),
        "moe_router_topk": router_topk(hf_config),
        # norm_topk: softmax over the top-k logits == renormalised full softmax; else softmax first.
        "moe_router_pre_softmax": not norm_topk_prob(hf_config, family),
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "moe_expert_capacity_factor": None,  # dropless, as transformers and SGLang
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
    }
    shared = shared_expert_size(hf_config, family)
    if shared:
        kw["moe_shared_expert_intermediate_size"] = shared
        kw["moe_shared_expert_gate"] = True
        kw["moe_shared_expert_overlap"] = False
    return kw


def ensure_megatron_moe_importable() -> None:
    """megatron-core 0.16.1's ``moe_utils`` names ``te_general_gemm`` in the router's GEMM without
    defining it when Transformer Engine is absent (a ``NameError`` on CPU and on CUDA hosts without
    TE); ``None`` selects its plain ``torch.mm`` branch, the one its own code means for that case."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
