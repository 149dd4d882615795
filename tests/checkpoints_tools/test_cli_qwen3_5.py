"""``mrl-ckpt`` on Qwen3.5's released vision-language checkpoint form: the decoder and the vision tower (which mrl
runs) convert, and HF → mcore (TP2) → reshard (TP1 × PP2) → HF (TP1 × PP2) is bit-exact for every tensor of the
source, vision tower included; the MoE form at EP2 likewise, its tower carried untouched (``carried.safetensors``). The
reshard moves the Gated DeltaNet's interleaved per-rank blocks (q | k | v | z | b | a) between TP sizes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoints_tools.test_cli import _cli, _hf_tensors, _ok
from tests.helpers.tiny_qwen3_5 import make_tiny_qwen3_5_hf

pytestmark = pytest.mark.multirank


def _same(src: Path, back: Path) -> None:
    from mrl.megatron.hf_io import HFCheckpointReader

    ref, got = _hf_tensors(src), HFCheckpointReader(back)  # the export writes the carried tensors as their own shard
    assert sorted(ref) == sorted(got.names()) and any(n.startswith("model.visual.") for n in got.names())
    for name, t in ref.items():
        g = got.get(name)
        assert g.dtype == t.dtype and torch.equal(g, t), name


def test_qwen3_5_roundtrip_with_reshard_converts_the_vision_tower(tmp_path: Path) -> None:
    hf = make_tiny_qwen3_5_hf(tmp_path / "hf", seed=2)
    m = tmp_path / "m_tp2"
    out = _ok(_cli("hf-to-mcore", "--hf", str(hf), "--out", str(m), "--tp", "2", "--device", "cpu"))
    # the tower is a Megatron parameter (vision_model.*), nothing is left to carry (the tiny model has no mtp.*)
    assert "carried untouched" not in out.stdout and not (m / "carried.safetensors").is_file(), out.stdout
    m2 = tmp_path / "m_pp2"
    _ok(_cli("reshard", "--in", str(m), "--out", str(m2), "--tp", "1", "--pp", "2", "--device", "cpu"))
    back = tmp_path / "hf_back"
    _ok(_cli("mcore-to-hf", "--mcore", str(m2), "--out", str(back), "--tp", "1", "--pp", "2", "--device", "cpu"))
    _same(hf, back)


def test_qwen3_5_moe_roundtrip_at_ep2(tmp_path: Path) -> None:
    hf = make_tiny_qwen3_5_hf(tmp_path / "hf", moe=True, seed=3)
    m = tmp_path / "m_ep2"
    out = _ok(_cli("hf-to-mcore", "--hf", str(hf), "--out", str(m), "--ep", "2", "--device", "cpu"))
    assert "carried untouched" in out.stdout and (m / "carried.safetensors").is_file(), out.stdout
    back = tmp_path / "hf_back"
    _ok(_cli("mcore-to-hf", "--mcore", str(m), "--out", str(back), "--device", "cpu"))
    _same(hf, back)
