"""The DeepSeek-V3.2 GPU recipe plans from mrl's bundled config.json, and that shape's parameter count (the lightning
indexer included) is transformers' own: ``DeepseekV32ForCausalLM`` built on the meta device from the bundled fields."""
from __future__ import annotations

import json
from pathlib import Path

from mrl.config import load_config
from mrl.config.hf import HUB_SHAPES, bundled_hub_shape
from mrl.config.plan_report import build_report

ROOT = Path(__file__).resolve().parents[2]
HUB = "deepseek-ai/DeepSeek-V3.2"


def test_bundled_shape_counts_transformers_parameters_and_the_recipe_plans() -> None:
    import torch
    import transformers as tf

    raw = json.loads((HUB_SHAPES / f"{HUB.replace('/', '--')}.json").read_text())
    raw = {k: v for k, v in raw.items() if not k.startswith("_mrl")}
    with torch.device("meta"):
        model = tf.DeepseekV32ForCausalLM(tf.DeepseekV32Config(**raw))
    shape = bundled_hub_shape(HUB)
    assert shape is not None and shape.dsa == (64, 128, 2048)
    assert shape.param_count() == sum(p.numel() for p in model.parameters())
    report = build_report(load_config(ROOT / "mrl_configs" / "deepseek-v3.2_grpo_20x8_pp16_ep8.yaml", []))
    assert report.param_count == shape.param_count() and report.memory["actor"].total > 0
