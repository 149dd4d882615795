"""DeepSeek sparse attention (DeepSeek-V3.2 ``DeepseekV32ForCausalLM``, GLM-5 ``GlmMoeDsaForCausalLM``) on Megatron's
MLA: logits == transformers' float64 logits within twice transformers' own float32 error (see :func:`tol`) at TP1, TP2 and
PP2, on rows of 20 tokens with ``index_topk`` = 4 (most keys masked); the same model
with a top-k covering every row (dense MLA) is far from them (the mask matters); packed rows (13, 1, 7, 19 tokens) ==
each sequence alone; HF → Megatron(TP2) → HF bit-exact per tensor, the indexer's included; the indexer is frozen
(no gradient, not in the optimizer) and every other tensor's gradient through the sparse mask equals transformers'
autograd. One 2-rank gloo launch."""
from __future__ import annotations

import pytest
import torch

from mrl.megatron.hf_io import HFCheckpointReader
from tests.helpers.dist import run_ranks
from tests.helpers.tiny_dsa import TOPK, make_tiny_dsa_hf, reference
from tests.helpers.tiny_moe_checkpoints import checkpoint_grads
from tests.megatron._dsa_ranks import CASES, LAYOUTS, dsa_parity_rank

pytestmark = pytest.mark.multirank
SEQ = 20  # 5 × index_topk: the late queries keep 4 of up to 20 keys
# The selection is a discontinuous function: parity needs every k-th/(k+1)-th index-score gap far above float32
# rounding of a sum of heads × dims products (~1e-6 relative here); the seeds give gaps >= 1e-3 (checked below).
MIN_GAP = 1e-4


def tol(err32: float) -> float:
    """Twice transformers' own float32 deviation from its float64 forward (same maths, other summation order and
    GEMM shapes in Megatron), never below 1e-6."""
    return max(2.0 * err32, 1e-6)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsa_parity")
    gen = torch.Generator().manual_seed(0)
    for i, case in enumerate(CASES):
        path = make_tiny_dsa_hf(root / case, case, seed=i + 1)
        ids = torch.randint(0, 96, (2, SEQ), generator=gen)
        torch.save({"ids": ids, **reference(path, ids)}, path / "ref.pt")
    merged: dict = {}
    for r in run_ranks(dsa_parity_rank, 2, args=(str(root),), timeout_s=400):
        merged.update(r)
    print("max |Δ|:", {k: v for k, v in sorted(merged.items(), key=str) if k[0] != "grads"})
    return root, merged


def _ref(root, case) -> dict:
    return torch.load(root / case / "ref.pt", weights_only=True)


@pytest.mark.parametrize("case", CASES)
def test_selection_is_stable_under_float32(launched, case):
    root, _ = launched
    assert SEQ > TOPK and _ref(root, case)["gap"] >= MIN_GAP


@pytest.mark.parametrize("case,layout", [(c, lay) for c in CASES for lay in LAYOUTS],
                         ids=[f"{c}-tp{lay[0]}pp{lay[1]}" for c in CASES for lay in LAYOUTS])
def test_logits_match_transformers(launched, case, layout):
    root, diffs = launched
    err32 = _ref(root, case)["err32"]
    assert diffs[(case, *layout)] <= tol(err32), f"transformers' own fp32 error: {err32:.2e}"


@pytest.mark.parametrize("case", CASES)
def test_the_top_k_mask_matters(launched, case):
    """Dense MLA (top-k over every key) on the same weights misses transformers' sparse logits by far more than the
    bound: a build that ignored the indexer's mask could not pass the parity test above."""
    root, diffs = launched
    assert diffs[("dense", case)] > 100 * tol(_ref(root, case)["err32"])


@pytest.mark.parametrize("case,tp", [(c, lay[0]) for c in CASES for lay in LAYOUTS if lay[1] == 1],
                         ids=[f"{c}-tp{lay[0]}" for c in CASES for lay in LAYOUTS if lay[1] == 1])
def test_packed_rows_equal_each_sequence_alone(launched, case, tp):
    root, diffs = launched
    assert diffs[("packed", case, tp)] <= tol(_ref(root, case)["err32"])


@pytest.mark.parametrize("case", CASES)
def test_roundtrip_is_bit_exact_with_the_indexer(launched, case):
    root, _ = launched
    src, out = HFCheckpointReader(root / case), HFCheckpointReader(root / f"rt_{case}")
    assert set(out.names()) == set(src.names())
    assert sum(".self_attn.indexer." in n for n in out.names()) == 5 * 4  # wq_b, wk, k_norm w/b, weights_proj
    for name in src.names():
        assert torch.equal(out.get(name), src.get(name)), name


@pytest.mark.parametrize("case", CASES)
def test_the_indexer_is_frozen_in_training(launched, case):
    _, diffs = launched
    f = diffs[("frozen", case)]
    assert f == {"indexer_tensors": 20, "indexer_frozen": True, "indexer_grads": 0, "indexer_in_optimizer": 0,
                 "others_trainable": True}, f


def _transformers_grads(path, ids) -> dict[str, torch.Tensor | None]:
    """d(sum of logits)/d(weight) by transformers' float64 autograd, under checkpoint names (its fused experts split
    per expert); None where transformers computes no gradient (the indexer: ``@torch.no_grad``)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, experts_implementation="eager").train()
    model(ids).logits.sum().backward()
    return checkpoint_grads(model)


@pytest.mark.parametrize("case", CASES)
def test_gradients_match_transformers(launched, case):
    """Megatron's backward through MLA under the top-k mask (TP1, fp32) = transformers' float64 autograd per HF
    tensor, within 1e-5 of each tensor's largest entry (float32 rounding of these few-hundred-term sums is ~1e-6
    relative); the indexer's tensors get none in either."""
    root, diffs = launched
    got = diffs[("grads", case)]
    want = _transformers_grads(root / case, _ref(root, case)["ids"])
    assert sorted(got) == sorted(want)
    frozen = [n for n in want if ".self_attn.indexer." in n]
    assert len(frozen) == 20 and all(want[n] is None and not got[n].any() for n in frozen)
    # transformers' embedding has padding_idx = pad_token_id (0): that row gets no gradient there, Megatron's does
    for d in (got, want):
        d["model.embed_tokens.weight"] = d["model.embed_tokens.weight"][1:]
    worst = max(((got[n].double() - want[n]).abs().max() / want[n].abs().max()).item() for n in want if n not in frozen)
    print(f"{case}: worst relative gradient difference {worst:.2e}")
    assert worst <= 1e-5, worst
