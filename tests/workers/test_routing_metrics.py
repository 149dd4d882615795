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
