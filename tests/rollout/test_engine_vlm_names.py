"""The embedded engine names a vision-language model's weights as its checkpoint does — and as the trainer's export
(:mod:`mrl.megatron.mapping`) sends them in a weight update: Qwen2.5-VL's released ``model.layers.*`` / ``visual.*``
(transformers' modules are ``model.language_model.*`` / ``model.visual.*``), Qwen3-VL's ``model.language_model.*`` /
``model.visual.*``, Qwen3-VL-MoE's fused experts in ``x @ W`` layout (``gate_up_proj [E, H, 2I]``, the
transposes of transformers' modules); each name views the module's own tensor, and a write under it lands there."""
from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_engine_weight_names_are_the_checkpoint_names(tmp_path, kind):
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    from mrl.rollout.engine.moe import checkpoint_views
    from tests.helpers.tiny_vlm import save_tiny_vlm

    path = save_tiny_vlm(tmp_path / kind, kind)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    views = checkpoint_views(model)
    assert set(saved) <= set(views)
    for n, t in saved.items():
        assert torch.equal(views[n], t), n
    with torch.no_grad():  # a weight update writes through the views (load_into_model: p.data.copy_)
        for n, t in saved.items():
            views[n].data.copy_(t + 1)
    fresh = checkpoint_views(model)  # rebuilt from the module's parameters
    for n, t in saved.items():
        assert torch.equal(fresh[n], t + 1), n
