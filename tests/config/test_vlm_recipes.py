"""The vision-language GPU recipes plan from mrl's copies of the released config.json (Qwen2.5-VL-7B's decoder fields at
the top level, Qwen3-VL-8B's and Qwen3-VL-30B-A3B's (MoE, EP8) under text_config), and the plan counts transformers' own parameters, the vision tower
included: the whole ``*ForConditionalGeneration`` built on the meta device (the family's tower count is torch-free)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mrl.config import load_config
from mrl.config.hf import HUB_SHAPES, bundled_hub_shape
from mrl.config.plan_report import build_report

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {"Qwen/Qwen2.5-VL-7B-Instruct": ("qwen2.5-vl-7b_grpo_geo3k_1x8.yaml", "Qwen2_5_VL"),
           "Qwen/Qwen3-VL-8B-Instruct": ("qwen3-vl-8b_grpo_geo3k_1x8.yaml", "Qwen3VL"),
           "Qwen/Qwen3-VL-30B-A3B-Instruct": ("qwen3-vl-30b-a3b_grpo_geo3k_1x8_ep8.yaml", "Qwen3VLMoe")}


@pytest.mark.parametrize("hub", sorted(RECIPES))
def test_recipe_plans_and_counts_transformers_parameters(hub: str) -> None:
    import torch
    import transformers as tf

    recipe, cls = RECIPES[hub]
    raw = json.loads((HUB_SHAPES / f"{hub.replace('/', '--')}.json").read_text())
    raw = {k: v for k, v in raw.items() if not k.startswith("_mrl")}
    with torch.device("meta"):
        model = getattr(tf, f"{cls}ForConditionalGeneration")(getattr(tf, f"{cls}Config")(**raw))
    shape = bundled_hub_shape(hub)
    assert shape is not None and shape.param_count() == sum(p.numel() for p in model.parameters())
    tower = sum(p.numel() for p in model.model.visual.parameters())
    assert shape.vision_params == tower
    cfg = load_config(ROOT / "mrl_configs" / recipe, [])
    frozen = build_report(cfg).memory["actor"]
    trained = build_report(load_config(ROOT / "mrl_configs" / recipe, ["actor.freeze_vision_tower=false"])).memory["actor"]
    assert frozen.weights == trained.weights
    assert trained.grads - frozen.grads == tower * 4  # fp32 main grads of the tower, replicated over TP
