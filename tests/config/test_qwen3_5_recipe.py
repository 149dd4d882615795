"""The Qwen3.5-35B-A3B GPU recipe plans from mrl's bundled decoder shape, and that shape's parameter counts are
transformers' own: ``Qwen3_5MoeForCausalLM`` built on the meta device from the bundled ``text_config`` (the decoder
the plan counts; the vision tower is carried, not trained)."""
from __future__ import annotations

import json
from pathlib import Path

from mrl.config import load_config
from mrl.config.hf import HUB_SHAPES, bundled_hub_shape

ROOT = Path(__file__).resolve().parents[2]
HUB = "Qwen/Qwen3.5-35B-A3B"


def test_bundled_shape_counts_transformers_parameters():
    import torch
    import transformers as tf

    s = bundled_hub_shape(HUB)
    assert s is not None and s.linear_layers == 30 and s.gdn == (16, 32, 128, 128, 4)
    raw = json.loads((HUB_SHAPES / f"{HUB.replace('/', '--')}.json").read_text())
    with torch.device("meta"):
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**raw["text_config"]))
    total = sum(p.numel() for p in model.parameters())
    assert s.param_count() == total, (s.param_count(), total)
    # active: one token runs 8 of the 256 routed experts of every layer (the shared expert always)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert s.param_count(active=True) == total - routed + routed * 8 // 256


def test_recipe_plans():
    cfg = load_config(ROOT / "mrl_configs" / "qwen3.5-35b-a3b_grpo_1x8_ep8.yaml", [])
    assert cfg.actor.megatron.expert_model_parallel_size == 8 and not cfg.actor.megatron.sequence_parallel
