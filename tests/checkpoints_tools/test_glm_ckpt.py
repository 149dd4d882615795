"""``mrl-ckpt`` on a tiny GLM-4.5 (``Glm4MoeForCausalLM``: sigmoid router with a score-correction bias, ungated
shared expert, qkv bias, q/k norm, partial RoPE, layer 0 dense) whose checkpoint also holds a
multi-token-prediction layer (``model.layers.4``, ``num_nextn_predict_layers=1``, as GLM-4.5's own):

* ``hf-to-mcore --ep 2`` skips the MTP layer; the mcore checkpoint, read here with torch's distributed-checkpoint
  reader (no mrl table), holds each MoE layer's router ``expert_bias`` = HF ``e_score_correction_bias`` and its
  shared expert's ``linear_fc1`` = ``cat(gate_proj, up_proj)``, ``linear_fc2`` = ``down_proj``;
* Megatron loading that checkpoint at EP1 gives transformers' logits of the ORIGINAL model (fp32, <= 1e-5);
* ``mcore-to-hf --ep 2`` gives back every decoder tensor bit for bit, and no MTP tensor (documented).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoints_tools.test_cli import _cli, _hf_tensors, _ok
from tests.checkpoints_tools.test_moe_logits import (
    _mcore_tensors,
    converted_logits_diff,
)
from tests.helpers.tiny_models import make_tiny_hf

pytestmark = pytest.mark.multirank

# Megatron's torch_dist keys of a model mixing dense and MoE layers: one per layer (not stacked)
_BIAS = "decoder.layers.{}.mlp.router.expert_bias"
_SHARED_FC1 = "decoder.layers.{}.mlp.shared_experts.linear_fc1.weight"
_SHARED_FC2 = "decoder.layers.{}.mlp.shared_experts.linear_fc2.weight"
_MTP = ("model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight", "model.layers.4.mlp.gate.weight")


def _glm_with_mtp(path: Path) -> Path:
    from safetensors.torch import load_file, save_file

    hf = make_tiny_hf(path, "glm4_moe", first_k_dense_replace=1, num_nextn_predict_layers=1)
    tensors = load_file(str(hf / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    tensors.update({n: torch.randn(64, 128 if "eh_proj" in n else 1, generator=g).squeeze(-1) for n in _MTP[:2]})
    tensors[_MTP[2]] = torch.randn(4, 64, generator=g)
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    return hf


def test_glm_checkpoint_converts_with_its_router_bias_and_shared_expert_and_skips_mtp(tmp_path: Path) -> None:

    from tests.megatron._ranks import MICRO_BATCH, NUM_MICRO, SEQ

    hf = _glm_with_mtp(tmp_path / "hf")
    ref = _hf_tensors(hf)
    m = tmp_path / "m_ep2"
    out = _ok(_cli("hf-to-mcore", "--hf", str(hf), "--out", str(m), "--ep", "2", "--device", "cpu", "--timeout", "240"))
    assert "2 cpu ranks" in out.stdout, out.stdout

    moe_layers = range(1, 4)  # layer 0 is dense
    got = _mcore_tensors(m, [k.format(li) for li in moe_layers for k in (_BIAS, _SHARED_FC1, _SHARED_FC2)])
    for li in moe_layers:
        x = f"model.layers.{li}.mlp."
        assert torch.equal(got[_BIAS.format(li)], ref[x + "gate.e_score_correction_bias"]), li
        gate, up = ref[x + "shared_experts.gate_proj.weight"], ref[x + "shared_experts.up_proj.weight"]
        assert torch.equal(got[_SHARED_FC1.format(li)], torch.cat([gate, up])), li
        assert torch.equal(got[_SHARED_FC2.format(li)], ref[x + "shared_experts.down_proj.weight"]), li

    ids = torch.randint(0, 300, (NUM_MICRO * MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    diff = converted_logits_diff(hf, m, ids)
    assert diff <= 1e-5, f"Megatron logits of the converted GLM checkpoint vs transformers' of the original: {diff:.3g}"

    back = tmp_path / "hf_back"
    _ok(_cli("mcore-to-hf", "--mcore", str(m), "--out", str(back), "--ep", "2", "--device", "cpu"))
    again = _hf_tensors(back)
    assert sorted(again) == sorted(n for n in ref if n not in _MTP), "the MTP layer is skipped, everything else kept"
    for name, t in again.items():
        assert t.dtype == ref[name].dtype and torch.equal(t, ref[name]), name
