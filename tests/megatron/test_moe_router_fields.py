"""The sigmoid-router fields of :class:`mrl.families.base.MoE` (score function, expert bias, group-limited
top-k, scaling, ungated shared expert): the Megatron router they configure picks the same experts with the
same weights as transformers' ``DeepseekV3TopkRouter`` (the oracle), and the settings where the two differ
are refused before Megatron starts."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mrl.families.base import MoE


def _moe(**kw) -> MoE:
    return MoE(block="mlp", expert_names=("gate_proj", "up_proj", "down_proj"),
               expert_ffn_size=lambda c: c.moe_intermediate_size, norm_topk=lambda c: c.norm_topk_prob,
               shared_expert_size=lambda c: c.moe_intermediate_size * c.n_shared_experts,
               score_function="sigmoid", expert_bias=True, num_groups=lambda c: c.n_group,
               group_topk=lambda c: c.topk_group, topk_scaling=lambda c: c.routed_scaling_factor,
               shared_expert_gate=False, **kw)


def _cfg(**kw) -> SimpleNamespace:
    base = {"num_experts": 16, "num_local_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                "norm_topk_prob": True, "routed_scaling_factor": 2.5, "moe_intermediate_size": 8, "n_shared_experts": 2,
                "num_hidden_layers": 2, "hidden_size": 12}
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("over", [{}, {"n_group": 1, "topk_group": 1}, {"topk_group": 4}])
def test_megatron_router_equals_transformers(over):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3TopkRouter,
    )

    cfg = _cfg(**over)
    moe = _moe()
    moe.check(cfg)
    kw = moe.transformer_kwargs(cfg, ep=1, etp=1)
    assert kw["moe_router_score_function"] == "sigmoid" and kw["moe_router_enable_expert_bias"]
    assert kw["moe_router_bias_update_rate"] == 0.0 and kw["moe_router_topk_scaling_factor"] == 2.5
    assert kw["moe_shared_expert_gate"] is False and kw["moe_shared_expert_intermediate_size"] == 16
    assert not kw["moe_router_pre_softmax"]
    hf = DeepseekV3TopkRouter(DeepseekV3Config(
        hidden_size=cfg.hidden_size, n_routed_experts=16, num_experts_per_tok=4, n_group=cfg.n_group,
        topk_group=cfg.topk_group, norm_topk_prob=True, routed_scaling_factor=2.5))
    g = torch.Generator().manual_seed(0)
    hf.weight.data = torch.randn(16, cfg.hidden_size, generator=g)
    hf.e_score_correction_bias.data = torch.randn(16, generator=g) * 0.3  # moves the choice off the top scores
    x = torch.randn(64, cfg.hidden_size, generator=g)
    logits, w_hf, idx_hf = hf(x)
    probs, rmap = topk_routing_with_score_function(
        logits, 4, use_pre_softmax=kw["moe_router_pre_softmax"], num_groups=kw.get("moe_router_num_groups"),
        group_topk=kw.get("moe_router_group_topk"), scaling_factor=kw["moe_router_topk_scaling_factor"],
        score_function="sigmoid", expert_bias=hf.e_score_correction_bias)
    dense_hf = torch.zeros_like(logits).scatter(1, idx_hf, w_hf)
    assert torch.equal(rmap, dense_hf > 0)
    torch.testing.assert_close(probs, dense_hf, rtol=0, atol=1e-6)
    assert (kw.get("moe_router_num_groups") is None) is (over != {})


@pytest.mark.parametrize("over,match", [
    ({"num_experts_per_tok": 6}, "top-2 experts.*top-3"),       # 6 // topk_group 2 = 3 != HF's 2
    ({"norm_topk_prob": False}, "norm_topk_prob=false with a sigmoid router"),
    ({"num_experts_per_tok": 1, "n_group": 1}, "num_experts_per_tok=1 with a sigmoid router"),
    ({"n_group": 3}, "n_group=3 does not divide the 16"),
])
def test_router_settings_megatron_cannot_compute_are_refused(over, match):
    with pytest.raises(ValueError, match=match):
        _moe().check(_cfg(**over))


def test_softmax_families_keep_their_settings():
    moe = MoE(block="mlp", expert_names=("a", "b", "c"), expert_ffn_size=lambda c: 8, norm_topk=lambda c: False,
              shared_expert_size=lambda c: 8)
    kw = moe.transformer_kwargs(_cfg(), ep=1, etp=1)
    assert kw["moe_router_score_function"] == "softmax" and kw["moe_router_pre_softmax"] is True
    assert kw["moe_shared_expert_gate"] is True
    assert not {"moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_topk_scaling_factor"} & set(kw)
    with pytest.raises(ValueError, match="expert bias needs the sigmoid"):
        MoE(block="mlp", expert_names=("a", "b", "c"), expert_ffn_size=lambda c: 8, norm_topk=lambda c: True,
            expert_bias=True).check(_cfg())
