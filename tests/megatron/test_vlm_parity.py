"""Qwen2.5-VL, Qwen3-VL (interleaved mRoPE, deepstack), Qwen3-VL-MoE (the same with Qwen3-MoE's experts, stored
fused in ``x @ W`` layout) and Qwen3.5 (hybrid Gated DeltaNet decoder, interleaved mRoPE on the rotated quarter of each
head; TP1 and TP2) through :class:`~mrl.workers.megatron_model.MegatronModel` (the vision tower on the first stage, its
features at the image tokens, multimodal RoPE at mrl's 3-D positions): each sample's fp32 logits == transformers'
float64 logits within 1e-5 at TP1 (DP2), TP2 and PP2 (Qwen3-VL-MoE: EP2 at TP1, and PP2), on padded rows and on packed rows (positions restarting per
sequence), for samples with one picture, two pictures and none, two micro-batches of two samples; packed == padded;
HF → Megatron → HF bit-exact per tensor at TP2 and PP2 (Qwen3-VL-MoE: EP2 and PP2), the tower (``visual.*`` / ``model.visual.*``) included. One
2-rank gloo launch for both models.

Bound: fp32 logits of a 2-layer model whose float64 values are ~1: transformers' own fp32 forward deviates from
float64 by ~3e-7 here (printed); 1e-5 (the issue's bound) leaves ×30 for Megatron's other GEMM shapes and sums."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.megatron._vlm_ranks import KINDS, LAYOUTS, ROUNDTRIP, vlm_parity_rank

pytestmark = pytest.mark.multirank
TOL = 1e-5


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    from tests.helpers.tiny_vlm import hf_vlm_logits, save_tiny_vlm, vlm_batch

    root = tmp_path_factory.mktemp("vlm_parity")
    for i, kind in enumerate(KINDS):
        save_tiny_vlm(root / kind, kind, seed=3 + i)
        batch = vlm_batch(root / kind)
        # eager experts: transformers' grouped-GEMM path has no float64 kernel
        model = AutoModelForImageTextToText.from_pretrained(root / kind, dtype=torch.float64,
                                                            experts_implementation="eager").eval()
        with torch.no_grad():
            logits = hf_vlm_logits(model, batch)
            own32 = hf_vlm_logits(model.float(), batch)
        print(kind, "transformers fp32 vs float64:",
              max((a.double() - b).abs().max().item() for a, b in zip(own32, logits)))
        torch.save({"batch": batch, "logits": logits, "vocab": model.config.text_config.vocab_size},
                   root / kind / "ref.pt")
    merged: dict = {}
    for r in run_ranks(vlm_parity_rank, 2, args=(str(root),), timeout_s=400):
        merged.update(r)
    print("max |Δ| per sample:", {k: [f"{v:.1e}" for v in vs] for k, vs in merged.items() if k[0] != "lg"})
    return root, merged


CASES = [(k, lay) for k in KINDS for lay in LAYOUTS[k]]
IDS = [f"{k}-tp{t}pp{p}" + (f"ep{e}" if e > 1 else "") for k, (t, p, e) in CASES]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("kind,layout", CASES, ids=IDS)
def test_logits_match_transformers(launched, kind, layout, packed):
    _, diffs = launched
    assert max(diffs[(kind, *layout, packed)]) <= TOL, diffs[(kind, *layout, packed)]


@pytest.mark.parametrize("kind,layout", CASES, ids=IDS)
def test_packed_rows_equal_padded_rows(launched, kind, layout):
    _, diffs = launched
    for a, b in zip(diffs[("lg", kind, *layout, True)], diffs[("lg", kind, *layout, False)]):
        assert (a - b).abs().max().item() <= TOL


RT_CASES = [(k, lay) for k, lay in CASES if lay in ROUNDTRIP]


@pytest.mark.parametrize("kind,layout", RT_CASES, ids=[f"{k}-tp{t}pp{p}ep{e}" for k, (t, p, e) in RT_CASES])
def test_roundtrip_is_bit_exact_with_the_vision_tower(launched, kind, layout):
    from mrl.families import FAMILIES
    from mrl.megatron.hf_io import HFCheckpointReader

    root, _ = launched
    src = HFCheckpointReader(root / kind)
    stages = [HFCheckpointReader(d) for d in sorted((root / "rt_{}_tp{}pp{}ep{}".format(kind, *layout)).iterdir())]
    exported = {n: st for st in stages for n in st.names()}
    assert sum(len(st.names()) for st in stages) == len(exported), "a tensor was exported twice"
    assert set(exported) == set(src.names())
    assert any(n.startswith(FAMILIES[kind].vision.prefix) for n in exported)
    for name, st in exported.items():
        assert torch.equal(st.get(name), src.get(name)), name
