"""``mrl-ckpt`` on a Qwen2.5-VL checkpoint (the vision tower converted and trained with the decoder, not carried):
HF → mcore (TP2) → reshard (TP1 × PP2) → HF (TP1 × PP2) is bit-exact for every tensor of the source, ``visual.*``
included (the tower lives on the first pipeline stage, replicated over TP), and the image processor's
``preprocessor_config.json`` travels with it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoints_tools.test_cli import _cli, _hf_tensors, _ok

pytestmark = pytest.mark.multirank


def test_qwen2_5_vl_roundtrip_with_reshard(tmp_path: Path) -> None:
    from mrl.megatron.hf_io import HFCheckpointReader
    from tests.helpers.tiny_vlm import save_tiny_vlm

    hf = save_tiny_vlm(tmp_path / "hf", "qwen2_5_vl", seed=4)
    m = tmp_path / "m_tp2"
    _ok(_cli("hf-to-mcore", "--hf", str(hf), "--out", str(m), "--tp", "2", "--device", "cpu"))
    assert not (m / "carried.safetensors").exists()  # the tower is a model parameter, not a carried tensor
    m2 = tmp_path / "m_pp2"
    _ok(_cli("reshard", "--in", str(m), "--out", str(m2), "--tp", "1", "--pp", "2", "--device", "cpu"))
    back = tmp_path / "hf_back"
    _ok(_cli("mcore-to-hf", "--mcore", str(m2), "--out", str(back), "--tp", "1", "--pp", "2", "--device", "cpu"))
    # the image processor's settings travel with the exported checkpoint (its engine and prompt files read them)
    assert (back / "preprocessor_config.json").read_text() == (hf / "preprocessor_config.json").read_text()
    ref, got = _hf_tensors(hf), HFCheckpointReader(back)
    assert sorted(ref) == sorted(got.names()) and any(n.startswith("visual.") for n in got.names())
    for name, t in ref.items():
        g = got.get(name)
        assert g.dtype == t.dtype and torch.equal(g, t), name
