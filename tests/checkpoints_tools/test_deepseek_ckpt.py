"""``mrl-ckpt`` on a tiny DeepSeek-V3 (MLA with q_lora_rank, dense first layer, 16 experts, sigmoid router with its
score-correction bias, one MTP layer in the checkpoint): HF → mcore at EP2 → HF at EP2 is bit-exact per tensor
(the MTP layer, never read, is not written back); the mcore checkpoint holds each MoE layer's HF
``e_score_correction_bias`` as the router's ``expert_bias`` (read with torch's distributed-checkpoint reader, not
mrl's table); and Megatron at EP1 from the converted checkpoint gives transformers' logits of the original."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints_tools.test_cli import _cli, _hf_tensors, _ok
from tests.checkpoints_tools.test_moe_logits import (
    _mcore_tensors,
    _megatron_logits_rank,
)
from tests.helpers.dist import run_ranks
from tests.helpers.tiny_deepseek import make_tiny_deepseek_hf

pytestmark = pytest.mark.multirank
_BIAS = "decoder.layers.{i}.mlp.router.expert_bias"  # per layer: a model mixing layer kinds is not stacked


def test_deepseek_v3_conversion_round_trip_bias_and_logits(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tests.megatron._ranks import MICRO_BATCH, NUM_MICRO, SEQ

    hf = make_tiny_deepseek_hf(tmp_path / "hf", seed=2)
    ids = torch.randint(0, 96, (NUM_MICRO * MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()(ids).logits
    ref = load_file(str(hf / "model.safetensors"))
    mtp = {"model.layers.4.eh_proj.weight": torch.randn(32, 64), "model.layers.4.enorm.weight": torch.ones(32)}
    save_file({**ref, **mtp}, str(hf / "model.safetensors"), metadata={"format": "pt"})

    m = tmp_path / "m_ep2"
    _ok(_cli("hf-to-mcore", "--hf", str(hf), "--out", str(m), "--ep", "2", "--device", "cpu", "--timeout", "240"))
    back = tmp_path / "hf_back"
    _ok(_cli("mcore-to-hf", "--mcore", str(m), "--out", str(back), "--ep", "2", "--device", "cpu"))
    got = _hf_tensors(back)
    assert sorted(got) == sorted(ref)  # no MTP tensor written back
    for name, t in ref.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name

    keys = [_BIAS.format(i=i) for i in (1, 2, 3)]  # layer 0 is dense: no router
    for i, (key, bias) in enumerate(_mcore_tensors(m, keys).items(), start=1):
        assert bias.dtype == torch.float32 and torch.equal(bias, ref[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]), key

    logits = torch.as_tensor(run_ranks(_megatron_logits_rank, 1, args=(str(m), ids.numpy()), timeout_s=240,
                                       init_process_group=False)[0])
    diff = float((logits - want).abs().max())
    assert diff <= 1e-5, f"Megatron logits of the converted checkpoint vs transformers' of the original: {diff:.3g}"
