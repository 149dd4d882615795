"""``mrl-ckpt`` on a tiny GLM-5 (DeepSeek sparse attention on MLA): HF → mcore at TP2 → HF at TP1 is bit-exact per
tensor, the lightning indexer's included; the mcore checkpoint holds each layer's indexer under Megatron's names as
one replicated tensor (read with torch's distributed-checkpoint reader, not mrl's table)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoints_tools.test_cli import _cli, _hf_tensors, _ok
from tests.checkpoints_tools.test_moe_logits import _mcore_tensors
from tests.helpers.tiny_dsa import make_tiny_dsa_hf

pytestmark = pytest.mark.multirank
_WQ_B = "decoder.layers.{i}.self_attention.core_attention.indexer.linear_wq_b.weight"


def test_glm5_conversion_round_trip_carries_the_indexer(tmp_path: Path) -> None:
    hf = make_tiny_dsa_hf(tmp_path / "hf", "glm_moe_dsa", seed=3)
    ref = load_file(str(hf / "model.safetensors"))
    assert sum(".self_attn.indexer." in n for n in ref) == 20
    m = tmp_path / "m_tp2"
    _ok(_cli("hf-to-mcore", "--hf", str(hf), "--out", str(m), "--tp", "2", "--device", "cpu", "--timeout", "240"))
    back = tmp_path / "hf_back"
    _ok(_cli("mcore-to-hf", "--mcore", str(m), "--out", str(back), "--device", "cpu"))
    got = _hf_tensors(back)
    assert sorted(got) == sorted(ref)
    for name, t in ref.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    keys = [_WQ_B.format(i=i) for i in range(4)]
    for i, (key, w) in enumerate(_mcore_tensors(m, keys).items()):
        assert torch.equal(w, ref[f"model.layers.{i}.self_attn.indexer.wq_b.weight"]), key
