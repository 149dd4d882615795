"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): DeepSeek-V3 (:mod:`mrl.families.deepseek_v3`: MLA, the sigmoid router
with its score-correction bias, shared expert, dense first layers) plus DeepSeek Sparse Attention in every layer.

Each attention layer's lightning indexer (HF ``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}``) scores every
earlier token for each query and MLA attends only the top ``index_topk`` (the math: :mod:`mrl.megatron.dsa`).
DeepSeek-V3.2's indexer rotates its first ``qk_rope_head_dim`` dims in the half-split layout (MLA itself keeps
DeepSeek's interleaved pairs); GLM-5 (:mod:`mrl.families.glm_moe_dsa`) differs there only. The indexer is replicated
over TP and frozen in RL (``mrl plan`` says so). Refused beyond DeepSeek-V3's refusals: no ``q_lora_rank`` (the
indexer reads MLA's query latent), ``index_head_dim < qk_rope_head_dim``.
"""
from __future__ import annotations

from typing import Any

from mrl.families import deepseek_v3 as v3
from mrl.families.base import Family, MoE
from mrl.families.rules import DENSE_MLP_OF_MIXED, MODEL_RULES, L, Rule, moe_rules

_INDEXER = (("linear_wq_b.weight", "wq_b.weight"), ("linear_wk.weight", "wk.weight"),
            ("k_norm.weight", "k_norm.weight"), ("k_norm.bias", "k_norm.bias"),
            ("linear_weights_proj.weight", "weights_proj.weight"))
# replicated on every TP rank (the indexer is small and its inputs are full there: mrl.megatron.dsa)
INDEXER = tuple(Rule("self_attention.core_attention.indexer." + m, (L + "self_attn.indexer." + h,), "replicated")
                for m, h in _INDEXER)


def mlp_layers(hf_config: Any) -> list[int]:
    """1 per MoE layer: config.json ``mlp_layer_types`` (``"dense"`` / ``"sparse"``), else the first
    ``first_k_dense_replace`` dense (what transformers' config derives)."""
    types = getattr(hf_config, "mlp_layer_types", None)
    n = int(hf_config.num_hidden_layers)
    if not types:
        return [int(i >= int(getattr(hf_config, "first_k_dense_replace", 0) or 0)) for i in range(n)]
    if len(types) != n or set(types) - {"dense", "sparse"}:
        raise ValueError(f"config.json mlp_layer_types={list(types)}: expected num_hidden_layers={n} entries of "
                         "'dense' / 'sparse'")
    return [int(t == "sparse") for t in types]


def dsa_sizes(rope_interleaved: bool):
    def sizes(hf_config: Any) -> dict[str, Any]:
        return {"n_heads": int(hf_config.index_n_heads), "head_dim": int(hf_config.index_head_dim),
                "topk": int(hf_config.index_topk), "rope_interleaved": rope_interleaved}
    return sizes


def refuse(hf_config: Any) -> None:
    """DeepSeek-V3's refusals, then the indexer's."""
    v3._refuse(hf_config)
    if getattr(hf_config, "q_lora_rank", None) is None:
        raise ValueError("config.json q_lora_rank is null: DeepSeek sparse attention's indexer reads MLA's query "
                         "latent (q_a_proj); a checkpoint without it is not this architecture")
    if int(hf_config.index_head_dim) < int(hf_config.qk_rope_head_dim) or int(hf_config.index_topk) < 1:
        raise ValueError(f"config.json index_head_dim={hf_config.index_head_dim} / index_topk={hf_config.index_topk}: "
                         f"the indexer rotates its first qk_rope_head_dim={hf_config.qk_rope_head_dim} dims and keeps "
                         "at least one token; fix the config")


def plan_notes(hf_config: Any) -> list[str]:
    """DeepSeek-V3's notes (router bias frozen, MTP layers skipped) and what RL does with the indexer."""
    return [*v3._plan_notes(hf_config), (
        f"DeepSeek sparse attention: each layer's lightning indexer (self_attn.indexer.*) picks the top "
        f"{int(hf_config.index_topk)} earlier tokens per query; the indexer is loaded, exported and frozen during RL "
        "(no gradient, not in the optimizer; transformers also computes it without grad). Its own training loss "
        "(DeepSeek-V3.2's KL indexer warm-up against dense attention) is not built")]


MOE = MoE(block="mlp", expert_names=v3._EXPERTS, expert_ffn_size=v3._expert_ffn, norm_topk=v3._norm_topk,
          shared_expert_size=v3._shared, layers=mlp_layers, score_function="sigmoid", expert_bias=True,
          num_groups=lambda c: getattr(c, "n_group", None), group_topk=lambda c: getattr(c, "topk_group", None),
          topk_scaling=v3._scaling, shared_expert_gate=False)
RULES = (MODEL_RULES + v3.MLA_ATTENTION + INDEXER + moe_rules("mlp", *v3._EXPERTS) + v3.ROUTER_BIAS
         + v3.UNGATED_SHARED_EXPERT + DENSE_MLP_OF_MIXED)

FAMILY = Family(
    name="deepseek_v32",
    architectures=("DeepseekV32ForCausalLM",),
    weight_rules=RULES,
    mla=v3.mla_kwargs,
    dsa=dsa_sizes(rope_interleaved=False),
    moe=MOE,
    refuse=refuse,
    plan_notes=plan_notes,
)
