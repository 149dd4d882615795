"""Megatron + LoRA == transformers + peft (fp32) at TP1, TP2, PP2, TP2×PP2 (and PP2×VPP2): logits, gradients of A
and B, and the merged HF export (= peft's merge_and_unload). One 4-rank gloo launch."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf
from tests.megatron._lora_ranks import lora_dropout_rank, lora_parity_rank
from tests.megatron._ranks import MICRO_BATCH, NUM_MICRO, SEQ

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES_DEF = {  # case -> (family, targets, r, alpha)
    "llama_all": ("llama", ALL, 4, 8.0),             # GQA, untied
    "qwen2_all": ("qwen2", ALL, 2, 16.0),            # qkv bias, tied embeddings
    "qwen2_qv": ("qwen2", ["q_proj", "v_proj"], 4, 4.0),  # k untargeted: zero block inside the fused qkv
}
LAYOUTS = [(1, 1, None), (2, 1, None), (1, 2, None), (2, 2, None)]  # (TP, PP, VPP)
CASES = {"llama_all": LAYOUTS + [(1, 2, 2)], "qwen2_all": LAYOUTS, "qwen2_qv": [(2, 1, None), (2, 2, None)]}
TOL = 1e-5  # fp32; same maths in another order (TP reductions, fused layouts). Grads: relative to max |grad|.


def _make_case(root, name: str, family: str, targets: list[str], r: int, alpha: float, seed: int) -> None:
    import peft
    import transformers as tf

    path = make_tiny_hf(root / name / "base", family)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:  # non-zero B (peft starts it at 0) with ΔW = (alpha/r)·B·A of the size of W
                scale = 0.2 if "lora_A" in n else 0.4 / (alpha / r)
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    pm.eval()
    V = model.config.vocab_size
    ids = torch.randint(0, V, (NUM_MICRO * MICRO_BATCH, SEQ), generator=gen)
    weight = torch.randn(NUM_MICRO * MICRO_BATCH, SEQ, V, generator=gen)
    logits = pm(input_ids=ids).logits
    (logits * weight).sum().backward()
    grads = {n.replace(".default", ""): p.grad.clone() for n, p in pm.named_parameters() if "lora_" in n}
    adapters = peft.get_peft_model_state_dict(pm)
    assert set(adapters) == set(grads)
    merged = {n: t.detach().clone() for n, t in pm.merge_and_unload().state_dict().items()}
    torch.save({"ids": ids, "weight": weight, "logits": logits.detach(), "grads": grads, "adapters": adapters,
                "merged": merged, "targets": targets, "r": r, "alpha": alpha}, root / name / "ref.pt")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    for i, (name, spec) in enumerate(CASES_DEF.items()):
        _make_case(root, name, *spec, seed=i)
    results = run_ranks(lora_parity_rank, 4, args=(str(root), CASES), timeout_s=300, init_process_group=False)
    merged: dict = {}
    for r in results:
        merged.update(r)
    print("LoRA parity (max over tensors):",
          {k: max(v.values()) if isinstance(v, dict) else v for k, v in sorted(merged.items(), key=str)})
    return root, merged


PARAMS = [(c, lay) for c, lays in CASES.items() for lay in lays]


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("case,layout", PARAMS, ids=[f"{c}-tp{l[0]}pp{l[1]}vpp{l[2]}" for c, l in PARAMS])
def test_lora_logits_and_grads_match_peft(launched, case, layout):
    launched = launched[1]
    diff = launched[(case, *layout, "logits")]
    assert diff <= TOL, f"{case} {layout}: max |Δlogits| = {diff:.3g}"
    grads = launched[(case, *layout, "grads")]
    targets = CASES_DEF[case][1]
    # Every targeted projection of every layer was exported by some stage; this one holds its layers.
    assert grads and all(any(f".{t}.lora_" in n for n in grads) for t in targets), sorted(grads)[:4]
    worst = max(grads.values())
    assert worst <= TOL, f"{case} {layout}: max |Δgrad(A, B)| / max |grad| = {worst:.3g}"


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("case", list(CASES))
def test_merged_export_matches_peft_merge(launched, case):
    launched = launched[1]
    diff = launched[(case, 2, 2, None, "merged")]
    assert diff <= 1e-6, f"{case}: merged export vs peft merge_and_unload max |Δ| = {diff:.3g}"
    for stage in (0, 1):
        n_lora, n_all = launched[(case, 2, 2, None, "only_lora", stage)]
        # Only the adapted projections of this stage's 2 layers: all seven, or q and v (k is unchanged).
        assert n_lora == 2 * len(CASES_DEF[case][1]), (case, stage, n_lora)
        assert n_lora < n_all


@pytest.mark.slow
@pytest.mark.multirank
def test_dropout_keeps_tensor_parallel_ranks_consistent(launched):
    root, _ = launched
    res = run_ranks(lora_dropout_rank, 2, args=(str(root),), timeout_s=180, init_process_group=False)
    for r in res:
        assert r["train_vs_eval"] > 1e-3  # dropout is on in train mode
        assert r["replicated_grad_diff"] == 0.0, r  # one mask per column input: replicated grads agree


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("case", list(CASES))
def test_initial_adapters_do_not_depend_on_the_layout(launched, case):
    _, res = launched
    inits = [res[(case, *lay, "init")] for lay in CASES[case]]
    full = inits[0] if CASES[case][0] == (1, 1, None) else {k: v for d in inits for k, v in d.items()}
    for d in inits:
        assert d and all(d[k] == full[k] for k in d), case
    assert all(v == 0 for k, v in full.items() if "lora_B" in k)
    a_sums = [v for k, v in full.items() if "lora_A" in k]
    assert len(set(a_sums)) == len(a_sums)  # every projection of every layer draws its own A
