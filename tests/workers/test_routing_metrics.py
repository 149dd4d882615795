"""moe/* means over the MoE layers only: a model mixing dense and MoE layers (Megatron's moe_layer_freq) has
dense layers without a router, which must not enter the load entropy, the max load share or the aux loss as
zeros. Probes stand in for routers (no torch.distributed: one process holds every layer). Tolerance 1e-7: mrl
divides by log E in float32, and Megatron tracks the loss in float32."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mrl.workers.routing_replay import moe_layer_mask, routing_metrics


class _Probe(SimpleNamespace):
    def reset(self) -> None:
        self.load.zero_()


def _probes(num_layers: int, loads: dict[int, list[float]]) -> list[_Probe]:
    router = SimpleNamespace(config=SimpleNamespace(num_layers=num_layers))
    return [_Probe(router=router, layer=i, load=torch.tensor(v, dtype=torch.float64),
                   mismatch=torch.zeros((), dtype=torch.long), compared=torch.zeros((), dtype=torch.long))
            for i, v in loads.items()]


def _entropy(load: list[float]) -> float:
    f = [x / sum(load) for x in load]
    return -sum(p * math.log(p) for p in f if p) / math.log(len(load))


def test_dense_layers_stay_out_of_the_means():
    loads = {1: [3.0, 1.0, 0.0, 0.0], 3: [1.0, 1.0, 1.0, 1.0]}  # layers 0 and 2 dense (no router)
    probes = _probes(4, loads)
    assert moe_layer_mask(probes).tolist() == [False, True, False, True]
    m = routing_metrics(probes, reset=False)
    assert m["moe/load_entropy"] == pytest.approx((_entropy(loads[1]) + _entropy(loads[3])) / 2, rel=1e-7)
    assert m["moe/max_load_frac"] == pytest.approx((0.75 + 0.25) / 2, rel=1e-7)
    assert sorted(k for k in m if k.startswith("moe/layer")) == ["moe/layer1/max_load_frac", "moe/layer3/max_load_frac"]


def test_aux_loss_mean_leaves_dense_layers_out(monkeypatch):
    from megatron.core.transformer.moe import moe_utils

    from mrl.workers.routing_replay import aux_loss_metrics

    tracker = {"load_balancing_loss": {"values": torch.tensor([0.0, 1.2, 0.0, 1.0])}}
    monkeypatch.setattr(moe_utils, "get_moe_layer_wise_logging_tracker", lambda: tracker)
    monkeypatch.setattr(moe_utils, "clear_aux_losses_tracker", lambda: None)
    mask = torch.tensor([False, True, False, True])
    m = aux_loss_metrics(0.05, 2, mask)  # 2 micro-batches: per micro-batch 0.6 and 0.5
    assert m["moe/load_balancing_loss"] == pytest.approx(0.55, rel=1e-7)
    assert m["moe/aux_loss"] == pytest.approx(0.05 * 0.55, rel=1e-7)


@pytest.mark.parametrize("groups", [1, 2])
def test_own_choice_of_a_biased_sigmoid_router_is_transformers_glm_choice(groups):
    """The probe's "own top-k" of a GLM-4.5 router (sigmoid + score-correction bias, groups) is what transformers'
    Glm4MoeTopkRouter picks (the engine's choice with the same weights: mismatch 0). The top-k of the raw
    logits, right for softmax routers, would count the tokens where the bias moves the choice."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    from mrl.workers.routing_replay import RouterProbe

    e, k, h = 8, 2, 16
    hf = Glm4MoeTopkRouter(Glm4MoeConfig(hidden_size=h, n_routed_experts=e, num_experts_per_tok=k, n_group=groups,
                                         topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5))
    g = torch.Generator().manual_seed(0)
    hf.weight.data = torch.randn(e, h, generator=g)
    hf.e_score_correction_bias.data = 0.5 * torch.randn(e, generator=g)
    x = torch.randn(64, h, generator=g)
    engine_ids = hf(x)[2]

    class _Router(torch.nn.Module):  # the attributes of Megatron's TopKRouter the probe reads
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(hf.weight.data.clone())
            self.register_buffer("expert_bias", hf.e_score_correction_bias.data.clone())
            self.topk, self.score_function, self.router_replay = k, "sigmoid", None
            self.config = SimpleNamespace(num_moe_experts=e, moe_router_pre_softmax=False, moe_router_score_function="sigmoid",
                                          moe_router_num_groups=groups if groups > 1 else None,
                                          moe_router_group_topk=1 if groups > 1 else None,
                                          moe_router_topk_scaling_factor=2.5)

        def gating(self, inp: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(inp, self.weight)

    router = _Router()
    probe = RouterProbe(router, 0, e)
    probe.target = engine_ids
    probe._pre(router, (x,))
    assert int(probe.compared) == 64 and int(probe.mismatch) == 0
    by_logits = torch.topk(router.gating(x), k, dim=1).indices.sort(-1).values
    assert (by_logits != engine_ids.sort(-1).values).any(-1).sum() > 0  # the bias decides: the old rule would count
