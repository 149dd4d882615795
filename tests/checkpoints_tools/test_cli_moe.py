"""``mrl-ckpt`` with ``--ep`` on a tiny Mixtral (4 experts): HF → mcore at EP2×PP2 (4 ranks; uneven stages: 3
layers, then 1) → reshard to EP4 → HF at EP2 is bit-exact per tensor, experts under their global indices."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.checkpoints_tools.test_cli import _cli, _hf_tensors, _ok
from tests.helpers.tiny_models import make_tiny_hf

pytestmark = pytest.mark.multirank


def test_moe_hf_mcore_reshard_hf_roundtrip_is_bit_exact(tmp_path: Path) -> None:
    hf = make_tiny_hf(tmp_path / "hf", "mixtral")
    m = tmp_path / "m_ep2pp2"
    out = _ok(_cli("hf-to-mcore", "--hf", str(hf), "--out", str(m), "--tp", "1", "--pp", "2", "--ep", "2",
                   "--num-layers-in-last-pipeline-stage", "1", "--device", "cpu", "--timeout", "240"))
    assert "4 cpu ranks" in out.stdout, out.stdout
    layout = json.loads((m / "mrl_checkpoint.json").read_text())["layout"]
    assert layout["pp"] == 2 and layout["num_layers_in_last_pipeline_stage"] == 1, layout  # the flag reached Megatron
    m4 = tmp_path / "m_ep4"
    _ok(_cli("reshard", "--in", str(m), "--out", str(m4), "--tp", "1", "--pp", "1", "--ep", "4", "--device", "cpu"))
    back = tmp_path / "hf_back"
    _ok(_cli("mcore-to-hf", "--mcore", str(m4), "--out", str(back), "--ep", "2", "--device", "cpu"))
    ref, got = _hf_tensors(hf), _hf_tensors(back)
    assert sorted(ref) == sorted(got) and any(".experts.3.w2." in n for n in got)
    for name, t in ref.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    bad = _cli("hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "x"), "--ep", "0", "--device", "cpu")
    assert bad.returncode == 2 and "--ep must be >= 1" in bad.stderr
