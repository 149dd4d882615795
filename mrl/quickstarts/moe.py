"""The MoE quickstart's assets, locally: ``python -m mrl.quickstarts moe [--family F]``.

The quickstart's task, tokenizer, data and warm start (:mod:`mrl.quickstarts.base`) with a tiny MoE model
instead of the dense Qwen2, one per ``--family`` (``FAMILIES``), each with its own default output directory
(its data too: the data's order follows the asset seed, and each family has its own) and its own recipe:

* ``qwen3_moe`` (default; ``outputs/quickstart_moe/tiny-qwen3-moe/``, ``mrl_configs/quickstart_moe.yaml``): hidden 64,
  4 layers, 4 heads / 2 KV heads (head_dim 16, q/k norm), **8 experts of width 128, top-2 routing with
  normalised top-k probabilities**, untied embeddings, vocab 300 (0.88M parameters, 0.29M active per
  token; with 8 experts of width 64 the same run learned more slowly: val 0.31 -> 0.75 at best in 400 steps).
* ``deepseek_v3`` (``outputs/quickstart_moe_deepseek/tiny-deepseek-v3/``, ``mrl_configs/quickstart_moe_deepseek.yaml``): DeepSeek-V3's
  architecture at the same width: multi-latent attention with ``q_lora_rank`` (4 heads, latent 32, nope 16 +
  rope 8 query/key dims, value 16) and YaRN RoPE, layer 0 a dense MLP (``first_k_dense_replace=1``), then
  8 routed experts of width 128 in 2 groups, top-2 inside the best group, sigmoid scores plus a
  score-correction bias for the choice, weights renormalised × ``routed_scaling_factor``, one ungated shared
  expert. HF initialises the bias to 0; here it is seeded random (``_score_bias``), as a trained
  checkpoint's is, so that it takes part in the choice (it stays frozen in RL, docs/moe.md). Its warm start
  rolls back a step that jumps past the target (``warm_start``'s ``roll_back``), so every seed starts at or below it.
* ``glm4_moe`` (``outputs/quickstart_moe_glm/tiny-glm4-moe/``, ``mrl_configs/quickstart_moe_glm.yaml``): GLM-4.5's
  architecture on the Qwen3-MoE demo's attention shape: partial RoPE (0.5), qkv bias, q/k norm, layer 0 dense,
  8 routed experts of width 128, top-2, the sigmoid router with its (seeded) score-correction bias, weights
  × ``routed_scaling_factor``, one ungated shared expert.

The recipes train them with GRPO on the 2 CPU ranks with the experts split over them (expert parallel 2)
and routing replay on (docs/moe.md).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from mrl.quickstarts.base import QWEN2_SHAPE, _add_arguments, writer
from mrl.quickstarts.cli import Demo

MODEL_DIR = "tiny-qwen3-moe"
QWEN3_MOE_SHAPE = {
    **{k: v for k, v in QWEN2_SHAPE.items() if k not in ("intermediate_size", "tie_word_embeddings")},
    "head_dim": 16, "tie_word_embeddings": False, "intermediate_size": 128,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
}
DEEPSEEK_DIR = "tiny-deepseek-v3"
DEEPSEEK_V3_SHAPE = {
    **{k: v for k, v in QWEN2_SHAPE.items() if k not in ("tie_word_embeddings", "rope_theta")},
    "num_key_value_heads": QWEN2_SHAPE["num_attention_heads"],  # MLA: one key/value per head
    "tie_word_embeddings": False,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                        "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0,
                        "beta_fast": 32, "beta_slow": 1},
    "first_k_dense_replace": 1, "moe_intermediate_size": 128, "n_routed_experts": 8, "num_experts_per_tok": 2,
    # Megatron scores a group by its top-(k / topk_group) sum and transformers by its top-2: equal at k = 2 · 1
    "n_group": 2, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_shared_experts": 1,
}
GLM4_MOE_DIR = "tiny-glm4-moe"
GLM4_MOE_SHAPE = {
    **{k: v for k, v in QWEN2_SHAPE.items() if k != "tie_word_embeddings"},
    "tie_word_embeddings": False, "head_dim": 16, "partial_rotary_factor": 0.5, "attention_bias": True,
    "use_qk_norm": True, "first_k_dense_replace": 1, "moe_intermediate_size": 128, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "n_shared_experts": 1,
}
SCORE_BIAS_STD = 0.05  # the routers' initial sigmoid scores spread by a few hundredths: the bias moves choices


def qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**QWEN3_MOE_SHAPE)


def deepseek_v3_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**DEEPSEEK_V3_SHAPE)


def glm4_moe_config():
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**GLM4_MOE_SHAPE)


def _score_bias(model: Any) -> None:
    """A seeded random score-correction bias (HF's init leaves it at 0; a trained checkpoint's is not)."""
    import torch

    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(SCORE_BIAS_STD * torch.randn_like(b))


GLM_SEED = 4


@dataclass(frozen=True)
class MoEFamily:
    model_dir: str
    hf_config: Any  # () -> transformers config
    recipe: str
    out: str  # the default --out, where the recipe reads the model and the data
    seed: int  # the default --seed: one whose warm start lands at the target, not past it (docs/moe.md)
    init: Any = None  # (model) -> None, before the warm start
    # warm_start's roll_back: a step that jumps past the target is undone, so every seed starts at or below it.
    # Off for the families whose documented assets (and measured runs) came from the plain rule.
    roll_back: bool = False


FAMILIES = {
    "qwen3_moe": MoEFamily(MODEL_DIR, qwen3_moe_config, "mrl_configs/quickstart_moe.yaml", "outputs/quickstart_moe", 1),
    "deepseek_v3": MoEFamily(DEEPSEEK_DIR, deepseek_v3_config, "mrl_configs/quickstart_moe_deepseek.yaml",
                             "outputs/quickstart_moe_deepseek", 2, _score_bias, roll_back=True),
    "glm4_moe": MoEFamily(GLM4_MOE_DIR, glm4_moe_config, "mrl_configs/quickstart_moe_glm.yaml",
                          "outputs/quickstart_moe_glm", GLM_SEED, _score_bias),
}
DEFAULT_FAMILY = "qwen3_moe"


def _arguments(p) -> None:
    _add_arguments(p)
    p.add_argument("--family", choices=sorted(FAMILIES), default=DEFAULT_FAMILY,
                   help=f"the tiny model's architecture (default {DEFAULT_FAMILY}); its default --out and --seed, "
                        "and the recipe that trains it: "
                        + "; ".join(f"{n}: {f.out}, seed {f.seed}, {f.recipe}" for n, f in sorted(FAMILIES.items())))


def _write(args) -> dict[str, str]:
    family = FAMILIES[args.family]  # argparse's choices refused any other name
    args = argparse.Namespace(**{**vars(args), "out": family.out if args.out is None else args.out,
                                 "seed": family.seed if args.seed is None else args.seed})
    return writer(family.model_dir, family.hf_config, family.init, family.roll_back)(args)


# --out and --seed default per --family (FAMILIES)
DEMO = Demo("moe", "the MoE quickstart: a tiny Qwen3-MoE, DeepSeek-V3 or GLM-4.5 (--family) on the quickstart's task",
            None, None, _arguments, _write)
