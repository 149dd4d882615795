"""MoE families from config.json (mrl/megatron/moe.py): the router settings Megatron gets, and the refusals."""
from __future__ import annotations

import pytest
import torch

from mrl.config.hf import shape_from_dict
from mrl.families import FAMILIES
from mrl.megatron.moe import check_moe_supported, moe_transformer_kwargs
from mrl.megatron.provider import _check_supported, model_family
from tests.helpers.tiny_models import hf_config


@pytest.mark.parametrize("family,pre_softmax,ffn,shared", [
    ("qwen3_moe", False, 48, None),   # norm_topk_prob=True: softmax over the top-k logits
    ("qwen2_moe", True, 48, 96),      # norm_topk_prob=False: softmax over all experts first, shared expert
    ("mixtral", False, 48, None),     # always renormalised; expert width in intermediate_size
])
def test_router_settings_from_config(family, pre_softmax, ffn, shared):
    cfg = hf_config(family)
    assert model_family(cfg) == family
    kw = moe_transformer_kwargs(cfg, family, ep=2, etp=1)
    assert kw["num_moe_experts"] == 4 and kw["moe_router_topk"] == 2 and kw["moe_ffn_hidden_size"] == ffn
    assert kw["moe_router_pre_softmax"] is pre_softmax and kw["moe_aux_loss_coeff"] == 0.01
    assert kw["moe_expert_capacity_factor"] is None and kw["expert_model_parallel_size"] == 2
    assert kw.get("moe_shared_expert_intermediate_size") == shared
    assert kw.get("moe_shared_expert_gate", False) is (shared is not None)
    with pytest.raises(ValueError, match="not divisible by expert_model_parallel_size=3"):
        moe_transformer_kwargs(cfg, family, ep=3, etp=1)


@pytest.mark.parametrize("family,overrides,pattern", [
    ("qwen3_moe", {}, None),                                           # all MoE: moe_layer_freq stays 1
    ("qwen3_moe", {"mlp_only_layers": [0]}, [0, 1, 1, 1]),
    ("qwen3_moe", {"decoder_sparse_step": 2}, [0, 1, 0, 1]),           # MoE iff (i + 1) % step == 0
    ("qwen2_moe", {"decoder_sparse_step": 3}, [0, 0, 1, 0]),
    ("qwen2_moe", {"decoder_sparse_step": 2, "mlp_only_layers": [3, 7]}, [0, 1, 0, 0]),  # 7: no such layer
    ("qwen3_moe", {"decoder_sparse_step": 1, "mlp_only_layers": [1, 2]}, [1, 0, 0, 1]),
])
def test_moe_layer_freq_from_config(family, overrides, pattern):
    """Qwen's decoder_sparse_step / mlp_only_layers -> Megatron's moe_layer_freq (a 0/1 list per layer), the
    rule transformers' Qwen{2,3}MoeDecoderLayer applies; checked against the transformers model's own layers."""
    import transformers as tf

    cfg = hf_config(family, **overrides)
    _check_supported(cfg, family)
    kw = moe_transformer_kwargs(cfg, family, ep=1, etp=1)
    assert kw.get("moe_layer_freq") == pattern
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(cfg)
    assert [int(hasattr(layer.mlp, "experts")) for layer in model.model.layers] == (pattern or [1, 1, 1, 1])
    # mrl plan's shape (mrl/config/hf.py, plain json) counts the dense layers' MLPs as transformers builds them
    shape = shape_from_dict(cfg.to_dict())
    assert shape.param_count() == sum(p.numel() for p in model.parameters())
    fam = FAMILIES[family]
    assert fam.layer_spec_kwargs(cfg)["moe_layers"] == pattern and fam.moe_layers(cfg) == (pattern or [1] * 4)


def test_unsupported_moe_layouts_are_refused_with_the_fix():
    cfg = hf_config("qwen3_moe", mlp_only_layers=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="every layer dense.*dense family"):
        _check_supported(cfg, "qwen3_moe")
    cfg = hf_config("mixtral", router_jitter_noise=0.1)
    with pytest.raises(ValueError, match="router_jitter_noise.*set it to 0.0"):
        check_moe_supported(cfg, "mixtral")


def test_deepseek_v2_is_refused_with_the_reason():
    import transformers as tf

    cfg = tf.DeepseekV2Config(num_hidden_layers=2, hidden_size=64, vocab_size=100)
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    with pytest.raises(ValueError, match="multi-latent attention"):
        model_family(cfg)


@pytest.mark.parametrize("q_lora", [True, False])
def test_deepseek_v3_plan_shape_counts_what_transformers_builds(q_lora):
    """mrl plan's parameter count (plain json, mrl/config/hf.py) of a DeepSeek-V3 config: MLA's latent projections
    and norms, a dense first layer, routers, routed and ungated shared experts, as transformers builds them."""
    import transformers as tf

    from tests.helpers.tiny_deepseek import deepseek_config

    cfg = deepseek_config(q_lora)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(cfg)
    shape = shape_from_dict(cfg.to_dict())
    assert shape.moe_layers == 3 and shape.shared_expert_size == 16 and not shape.shared_expert_gate
    assert shape.param_count() == sum(p.numel() for p in model.parameters())
    moe = model.model.layers[1].mlp
    inactive = (shape.num_experts - shape.experts_per_token) * sum(p.numel() for p in moe.experts.parameters()) \
        // shape.num_experts
    assert shape.param_count(active=True) == shape.param_count() - 3 * inactive


@pytest.mark.parametrize("overrides,match", [
    ({"rope_interleave": False}, "rope_interleave=false"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config.*fp8_cast_bf16"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32,
                          "mscale_all_dim": 0.8}}, "mscale_all_dim without mscale"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32,
                          "truncate": False}}, "truncate=false"),
    ({"num_experts_per_tok": 6}, "top-2 experts.*top-3"),
    ({"norm_topk_prob": False}, "norm_topk_prob=false"),
])
def test_deepseek_v3_settings_megatron_computes_otherwise_are_refused(overrides, match):
    """Each refusal names the config.json key and the fix, before Megatron starts."""
    from tests.helpers.tiny_deepseek import deepseek_config

    _check_supported(deepseek_config(), "deepseek_v3")  # the tiny parity model itself passes
    with pytest.raises(ValueError, match=match):
        _check_supported(deepseek_config(**overrides), "deepseek_v3")
