"""A converted MoE checkpoint is the original model, not only its own round trip.

``mrl-ckpt hf-to-mcore --ep 2`` (2 gloo ranks, ``main`` in this process as in test_cli.py) on a tiny Qwen3-MoE
(4 layers, 4 experts, top-2); then, with no use of mrl's HF <-> Megatron table:

* the mcore checkpoint's tensors, read here with torch's distributed-checkpoint reader (Megatron's
  ``torch_dist`` format: experts stacked as ``[layers, experts, ...]`` under their global index): for every
  layer and expert e, ``linear_fc1[l, e]`` is ``cat(gate_proj, up_proj)`` of HF expert e (Megatron's SwiGLU:
  ``act(first half) * second half``), ``linear_fc2[l, e]`` its ``down_proj``, ``router[l]`` the HF ``mlp.gate``;
* Megatron loads the checkpoint at EP1 (1 rank: the experts gathered from both EP ranks' files) and its
  logits equal transformers' logits of the ORIGINAL HF model (fp32, ≤ 1e-5).

A mapping bug that both directions share (gate and up swapped, experts permuted) passes the round trip of
test_cli_moe.py; here the slices and the logits both fail.

gpt-oss (fused expert tensors with gate/up interleaved, biases everywhere, attention sinks): converted at TP2×EP2
(ETP1; 2 ranks, EP folded over TP), its mcore tensors (the TP-split sinks whole again) checked against the HF
slices, and its logits at TP1/EP1 equal transformers'. (HF → Megatron(EP2×PP2) → HF of the fused experts is
bit-exact in tests/megatron/test_moe_parity.py; mrl-ckpt's mcore-to-hf at EP2 in test_cli_moe.py.)
"""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tests.checkpoints_tools.test_cli import _cli, _ok
from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf

pytestmark = pytest.mark.multirank

_FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
_FC2 = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
_ROUTER = "decoder.layers.mlp.router.weight"


def _megatron_logits_rank(rank: int, world: int, ckpt: str, ids) -> object:
    """Megatron at TP1/PP1/EP1 from the mcore checkpoint alone (its config.json): logits of ``ids``."""
    from mrl.megatron.checkpoint import load_checkpoint
    from mrl.megatron.parallel import init_parallel
    from mrl.megatron.provider import build_model_chunks, load_hf_config
    from tests.megatron._ranks import pipeline_logits

    init_parallel(device="cpu", tp=1, pp=1, ep=1)
    cfg = load_hf_config(ckpt)
    chunks = build_model_chunks(cfg)
    load_checkpoint(ckpt, chunks)
    return pipeline_logits(chunks, cfg, torch.as_tensor(ids)).numpy()


def converted_logits_diff(hf: Path, mcore: Path, ids: torch.Tensor) -> float:
    """max |logits of Megatron built from the converted ``mcore`` checkpoint alone - transformers' logits of the HF
    original ``hf``| on ``ids`` (the transformers side never touches mrl's code)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(ids).logits
    logits = torch.as_tensor(run_ranks(_megatron_logits_rank, 1, args=(str(mcore), ids.numpy()), timeout_s=240,
                                       init_process_group=False)[0])
    return float((logits - want).abs().max())


def _mcore_tensors(ckpt: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """Global tensors of a torch_dist checkpoint, read in this process (no process group)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(ckpt))
    meta = reader.read_metadata().state_dict_metadata
    out = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in keys}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def test_converted_moe_checkpoint_holds_the_hf_experts_and_gives_transformers_logits(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from tests.megatron._ranks import MICRO_BATCH, NUM_MICRO, SEQ

    hf = make_tiny_hf(tmp_path / "hf", "qwen3_moe")
    m = tmp_path / "m_ep2"
    out = _ok(_cli("hf-to-mcore", "--hf", str(hf), "--out", str(m), "--ep", "2", "--device", "cpu", "--timeout", "240"))
    assert "2 cpu ranks" in out.stdout, out.stdout

    ref = load_file(str(hf / "model.safetensors"))
    got = _mcore_tensors(m, [_FC1, _FC2, _ROUTER])
    layers, experts = got[_FC1].shape[:2]
    assert (layers, experts) == (4, 4)
    for li in range(layers):
        assert torch.equal(got[_ROUTER][li], ref[f"model.layers.{li}.mlp.gate.weight"]), li
        for e in range(experts):
            x = f"model.layers.{li}.mlp.experts.{e}."
            gate, up, down = (ref[x + p + ".weight"] for p in ("gate_proj", "up_proj", "down_proj"))
            fc1 = got[_FC1][li, e]
            assert fc1.shape == (2 * gate.shape[0], gate.shape[1]), (li, e, fc1.shape)
            assert torch.equal(fc1[: gate.shape[0]], gate), f"layer {li} expert {e}: fc1's first half is not gate_proj"
            assert torch.equal(fc1[gate.shape[0]:], up), f"layer {li} expert {e}: fc1's second half is not up_proj"
            assert torch.equal(got[_FC2][li, e], down), f"layer {li} expert {e}: fc2 is not down_proj"

    ids = torch.randint(0, 300, (NUM_MICRO * MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    diff = converted_logits_diff(hf, m, ids)
    assert diff <= 1e-5, f"Megatron logits of the converted checkpoint vs transformers' of the original: {diff:.3g}"


def test_converted_gpt_oss_checkpoint_holds_the_hf_tensors_and_gives_transformers_logits(
        tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from tests.megatron._ranks import MICRO_BATCH, NUM_MICRO, SEQ

    hf = make_tiny_hf(tmp_path / "hf", "gpt_oss")
    m = tmp_path / "m_tp2ep2"
    _ok(_cli("hf-to-mcore", "--hf", str(hf), "--out", str(m), "--tp", "2", "--ep", "2", "--etp", "1", "--device", "cpu",
             "--timeout", "240"))
    ref = load_file(str(hf / "model.safetensors"))
    keys = {k: f"decoder.layers.mlp.experts.experts.{k}" for k in
            ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")}
    sinks, rbias = "decoder.layers.self_attention.core_attention.softmax_offset", "decoder.layers.mlp.router.bias"
    got = _mcore_tensors(m, [*keys.values(), sinks, rbias])
    for li in range(4):
        x = f"model.layers.{li}."
        assert torch.equal(got[sinks][li], ref[x + "self_attn.sinks"]), li
        assert torch.equal(got[rbias][li], ref[x + "mlp.router.bias"]), li
        for e in range(4):
            gate_up, gu_bias = ref[x + "mlp.experts.gate_up_proj"][e], ref[x + "mlp.experts.gate_up_proj_bias"][e]
            # transformers: gate_up = h @ W + b, gate = [..., ::2], up = [..., 1::2]; Megatron: fc1 = [gate; up] rows
            assert torch.equal(got[keys["linear_fc1.weight"]][li, e], torch.cat([gate_up[:, ::2].t(), gate_up[:, 1::2].t()]))
            assert torch.equal(got[keys["linear_fc1.bias"]][li, e], torch.cat([gu_bias[::2], gu_bias[1::2]]))
            assert torch.equal(got[keys["linear_fc2.weight"]][li, e], ref[x + "mlp.experts.down_proj"][e].t())
            assert torch.equal(got[keys["linear_fc2.bias"]][li, e], ref[x + "mlp.experts.down_proj_bias"][e])

    ids = torch.randint(0, 300, (NUM_MICRO * MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    diff = converted_logits_diff(hf, m, ids)
    assert diff <= 1e-5, f"gpt-oss: Megatron logits of the converted checkpoint vs transformers' of the original: {diff:.3g}"
