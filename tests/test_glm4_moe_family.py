"""GLM-4.5 family facts without the model stack: what its config.json switches (qkv bias, q/k norm, dense first
layers, groups, routed scaling) becomes in Megatron's settings and in the weight table, what is refused with the
fix, and the shape ``mrl plan`` reads (parameter counts of the bundled GLM-4.5 / GLM-4.5-Air config.json,
and of a tiny model against transformers' own count)."""
from __future__ import annotations

import pytest

from mrl.config.hf import bundled_hub_shape, shape_from_dict
from mrl.families import FAMILIES
from mrl.families.rules import QK_NORM, QKV_BIAS
from tests.helpers.tiny_models import build_tiny_model, hf_config

GLM = FAMILIES["glm4_moe"]


def test_config_switches_reach_megatron_and_the_weight_table():
    on = hf_config("glm4_moe", first_k_dense_replace=1, routed_scaling_factor=2.5)
    kw = GLM.transformer_kwargs(on, ep=2)
    assert kw["add_qkv_bias"] and kw["qk_layernorm"] and kw["moe_layer_freq"] == [0, 1, 1, 1]
    assert kw["moe_router_score_function"] == "sigmoid" and kw["moe_router_enable_expert_bias"]
    assert kw["moe_router_bias_update_rate"] == 0.0 and kw["moe_router_topk_scaling_factor"] == 2.5
    assert kw["moe_shared_expert_intermediate_size"] == 48 and kw["moe_shared_expert_gate"] is False
    assert "moe_router_num_groups" not in kw  # n_group=1: no group restriction
    assert set(QKV_BIAS + QK_NORM) <= set(GLM.weight_rules_for(on))

    off = hf_config("glm4_moe", attention_bias=False, use_qk_norm=False, n_group=2, topk_group=1)
    GLM.check(off)
    kw = GLM.transformer_kwargs(off)
    assert not kw["add_qkv_bias"] and not kw["qk_layernorm"] and not GLM.layer_spec_kwargs(off)["qk_layernorm"]
    assert (kw["moe_router_num_groups"], kw["moe_router_group_topk"]) == (2, 1)
    assert not set(QKV_BIAS + QK_NORM) & set(GLM.weight_rules_for(off))
    assert len(GLM.weight_rules_for(off)) == len(GLM.weight_rules) - len(QKV_BIAS + QK_NORM)


def test_partial_rope_is_megatrons_rotary_percent():
    from mrl.megatron.provider import rotary_percent

    assert rotary_percent(hf_config("glm4_moe")) == 0.5
    assert rotary_percent(hf_config("qwen3")) == 1.0
    with pytest.raises(ValueError, match="partial_rotary_factor=0.3125"):  # 16 * 0.3125 = 5 channels: odd
        rotary_percent(hf_config("glm4_moe", partial_rotary_factor=0.3125))


@pytest.mark.parametrize("over,match", [
    ({"norm_topk_prob": False}, "norm_topk_prob=false with a sigmoid router"),
    ({"n_group": 4, "topk_group": 2}, "top-2 experts.*top-1"),  # top-2 over 2 of 4 groups: Megatron scores top-1
    ({"first_k_dense_replace": 4}, "every layer dense"),
])
def test_what_megatron_would_compute_differently_is_refused(over, match):
    with pytest.raises(ValueError, match=match):
        GLM.check(hf_config("glm4_moe", **over))


def test_plan_notes_say_the_bias_is_frozen_and_mtp_layers_are_skipped():
    notes = " ".join(GLM.plan_notes(hf_config("glm4_moe", num_nextn_predict_layers=1)))
    assert "frozen" in notes and "model.layers.4" in notes and "skipped" in notes


def test_tiny_model_parameter_count_equals_transformers():
    model = build_tiny_model("glm4_moe", first_k_dense_replace=1, use_qk_norm=True)
    shape = shape_from_dict(model.config.to_dict())
    assert shape.qk_norm and shape.qkv_bias and not shape.shared_expert_gate and shape.moe_layers == 3
    assert shape.param_count() == sum(p.numel() for p in model.parameters())


def test_bundled_glm_shapes_of_the_gpu_recipes():
    big, air = bundled_hub_shape("zai-org/GLM-4.5"), bundled_hub_shape("zai-org/GLM-4.5-Air")
    assert big.qk_norm and not air.qk_norm and (big.moe_layers, air.moe_layers) == (89, 45)
    # "355B-A32B" / "106B-A12B" (the names count the MTP layer, mrl does not; active includes the embeddings)
    assert round(big.param_count() / 1e9, 1) == 352.8 and 33.5 < big.param_count(active=True) / 1e9 < 33.7
    assert round(air.param_count() / 1e9, 1) == 106.9 and 13.3 < air.param_count(active=True) / 1e9 < 13.5


def test_plan_refuses_what_the_family_refuses_before_anything_starts(tmp_path):
    """``mrl plan`` / ``check_config`` run the family's own refusals on config.json (as the ranks would, later)."""
    import json

    from mrl.config import load_config
    from mrl.config.validate import check_config

    def errors(path: str) -> list[str]:
        cfg = load_config("mrl_configs/quickstart_moe.yaml", [f"model.path={path}"], check=False)
        return [e for e in check_config(cfg)[0] if "model.path" in e]

    cfg = hf_config("glm4_moe").to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "norm_topk_prob": False}))
    (bad,) = errors(str(tmp_path))
    assert f"{tmp_path}/config.json" in bad and "norm_topk_prob=false" in bad
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert errors(str(tmp_path)) == []
    assert errors("zai-org/GLM-4.5") == errors("zai-org/GLM-4.5-Air") == []  # the recipes' bundled shapes
