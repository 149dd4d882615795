"""Megatron + LoRA == transformers + peft (fp32) at TP1, TP2, PP2, TP2×PP2 (and PP2×VPP2): logits, gradients of A
and B, and the merged HF export (= peft's merge_and_unload). The hybrid decoders (Qwen3.5's vision-language release
and text-only form, Qwen3-Next) with adapters on the gated q_proj and the Gated DeltaNet projections at TP1 and TP2,
against peft in float64 (see hybrid_tol), and their peft export loading in peft. One 4-rank gloo launch."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_hybrid import make_tiny_hybrid_hf
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
GDN = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
HYBRID_DEF = {  # case -> (tiny_hybrid kind, targets, r, alpha, layout of the export checks, merge oracle)
    # decoder under model.language_model.; gated q_proj; every GDN projection; dense MLP
    "qwen3_5_vl": ("qwen3_5", ALL + GDN, 4, 8.0, (2, 1, None), True),
    # text-only names (model.layers.); k/v/o and in_proj_z/b untargeted: zero blocks in both fused linears
    "qwen3_5_text": ("qwen3_5_text", ["q_proj", "in_proj_qkv", "in_proj_a", "out_proj", "down_proj"], 2, 4.0,
                     (1, 1, None), True),
    # grouped in_proj_qkvz / in_proj_ba, attention. No MLP targets: peft 0.21 reads gate/up/down_proj of a
    # transformers-5 MoE as the routed experts' fused tensors (docs/moe.md), and transformers keeps those fused in its
    # state dict, so there is no per-tensor merge oracle here
    "qwen3_next": ("qwen3_next", ["q_proj", "v_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"], 2, 8.0,
                   (2, 1, None), False),
    # the MoE release (vision-language, gated shared expert), attention and GDN targets as for Qwen3-Next
    "qwen3_5_moe": ("qwen3_5_moe", ["q_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"], 2, 8.0, (1, 1, None),
                    False),
}
CASES = {"llama_all": LAYOUTS + [(1, 2, 2)], "qwen2_all": LAYOUTS, "qwen2_qv": [(2, 1, None), (2, 2, None)],
         "qwen3_5_vl": [(1, 1, None), (2, 1, None), (1, 2, None)], "qwen3_5_text": [(1, 1, None)],
         "qwen3_next": [(1, 1, None), (2, 1, None)], "qwen3_5_moe": [(1, 1, None)]}  # TP1: two key-head groups on a rank (TP2 holds one)
# the Megatron checkpoint of the adapters: saved at the first layout, loaded at the second (another TP)
CKPT = {"qwen3_5_vl": ((1, 1, None), (2, 1, None))}
TOL = 1e-5  # fp32; same maths in another order (TP reductions, fused layouts). Grads: relative to max |grad|.


def hybrid_tol(err32: float, factor: float = 2.0) -> float:
    """As the Qwen3.5 parity test: the truth is peft on transformers in float64; peft's own float32 run deviates from it
    by err32 (the delta rule's triangular solves amplify rounding); Megatron's float32 logits must stay within twice
    that, and never need to beat 1e-6. Gradients (relative to each tensor's max) get ``factor`` 10: they also pass the
    delta rule's backward, which Megatron takes through mrl's own chunked kernel (mrl/megatron/delta_rule.py, another
    solve order than transformers' fallback), so its float32 error and transformers' are two independent errors of
    that scale (measured up to 3 apart here; other hosts' reduction orders move both); a wrong adapter block is an
    error of order 1, four orders above the bound."""
    return max(factor * err32, 1e-6)


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


def _randomise_adapters(pm, r: int, alpha: float, gen: torch.Generator) -> None:
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:  # non-zero B (peft starts it at 0) with ΔW = (alpha/r)·B·A of the size of W
                scale = 0.2 if "lora_A" in n else 0.4 / (alpha / r)
                p.copy_(scale * torch.randn(p.shape, generator=gen))


def _forward_backward(pm, ids, weight):
    logits = pm(input_ids=ids).logits
    (logits * weight).sum().backward()
    grads = {n.replace(".default", ""): p.grad.clone() for n, p in pm.named_parameters() if "lora_" in n}
    pm.zero_grad()
    return logits.detach(), grads


def hf_model(path):
    """The checkpoint's own architecture (``Qwen3_5ForConditionalGeneration`` for the release, ...ForCausalLM)."""
    import json

    import transformers as tf

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    return getattr(tf, arch).from_pretrained(str(path), dtype=torch.float32, experts_implementation="eager").eval()


def _make_hybrid_case(root, name, kind, targets, r, alpha, merged_at, merge, seed):
    """ref.pt of a hybrid case: peft's float64 logits and A/B gradients (the truth), the float32 ones' deviation from
    them (err32, grads relative to each tensor's max), the adapters and peft's float32 merge_and_unload."""
    import peft

    path = make_tiny_hybrid_hf(root / name / "base", kind, seed=seed)
    pm = peft.get_peft_model(hf_model(path), peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0,
                                                             target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    _randomise_adapters(pm, r, alpha, gen)
    pm.eval()
    V = pm.get_base_model().config.get_text_config().vocab_size
    ids = torch.randint(0, V, (NUM_MICRO * MICRO_BATCH, SEQ), generator=gen)
    weight = torch.randn(NUM_MICRO * MICRO_BATCH, SEQ, V, generator=gen)
    logits32, grads32 = _forward_backward(pm, ids, weight)
    adapters = {n: t.clone() for n, t in peft.get_peft_model_state_dict(pm).items()}
    logits, grads = _forward_backward(pm.double(), ids, weight.double())
    assert set(adapters) == set(grads)
    err32 = (logits32 - logits).abs().max().item()
    err32_grads = max(((grads32[n] - g).abs().max() / g.abs().max()).item() for n, g in grads.items())
    pm.float()  # the float32 values back exactly (every one was drawn in float32)
    merged = {n: t.detach().clone() for n, t in pm.merge_and_unload().state_dict().items()} if merge else None
    torch.save({"ids": ids, "weight": weight, "logits": logits, "grads": grads, "adapters": adapters, "merged": merged,
                "targets": targets, "r": r, "alpha": alpha, "merged_at": merged_at, "err32": err32,
                "err32_grads": err32_grads, "logits32": logits32, "ckpt": CKPT.get(name, (None, None))},
               root / name / "ref.pt")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    for i, (name, spec) in enumerate(CASES_DEF.items()):
        _make_case(root, name, *spec, seed=i)
    for i, (name, spec) in enumerate(HYBRID_DEF.items()):
        _make_hybrid_case(root, name, *spec, seed=10 + i)
    results = run_ranks(lora_parity_rank, 4, args=(str(root), CASES), timeout_s=300, init_process_group=False)
    merged: dict = {}
    for r in results:
        merged.update(r)
    def short(v):  # a dict per tensor: its max; a peft round trip (names, max |Δ|): how many names
        if isinstance(v, dict):
            return max(v.values())
        return (len(v[0]), v[1]) if isinstance(v, tuple) and isinstance(v[0], list) else v

    print("LoRA parity (max over tensors):", {k: short(v) for k, v in sorted(merged.items(), key=str)})
    print("peft's own float32 error (logits, grads):", {c: tuple(torch.load(root / c / "ref.pt", weights_only=True)[k]
                                                         for k in ("err32", "err32_grads")) for c in HYBRID_DEF})
    return root, merged


PARAMS = [(c, lay) for c, lays in CASES.items() for lay in lays]


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("case,layout", PARAMS, ids=[f"{c}-tp{l[0]}pp{l[1]}vpp{l[2]}" for c, l in PARAMS])
def test_lora_logits_and_grads_match_peft(launched, case, layout):
    root, launched = launched
    tol = tol_grads = TOL
    if case in HYBRID_DEF:
        ref = torch.load(root / case / "ref.pt", weights_only=True)
        tol, tol_grads = hybrid_tol(ref["err32"]), hybrid_tol(ref["err32_grads"], factor=10.0)
    diff = launched[(case, *layout, "logits")]
    assert diff <= tol, f"{case} {layout}: max |Δlogits| = {diff:.3g}"
    grads = launched[(case, *layout, "grads")]
    targets = (CASES_DEF.get(case) or HYBRID_DEF[case])[1]
    # Every targeted projection of every layer was exported by some stage; this one holds its layers.
    assert grads and all(any(f".{t}.lora_" in n for n in grads) for t in targets), sorted(grads)[:4]
    worst = max(grads.values())
    assert worst <= tol_grads, f"{case} {layout}: max |Δgrad(A, B)| / max |grad| = {worst:.3g}"


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("case", list(HYBRID_DEF))
def test_hybrid_peft_export_round_trips_and_loads_in_peft(launched, case):
    """The adapters loaded from peft's names come back unchanged under the same names (the decoder prefix of the
    vision-language release included), and the files mrl writes load with ``PeftModel.from_pretrained`` onto the
    transformers model, giving peft's own float32 logits."""
    import peft

    root, res = launched
    ref = torch.load(root / case / "ref.pt", weights_only=True)
    names, diff = res[(case, *HYBRID_DEF[case][4], "peft_roundtrip", 0)]
    assert names == sorted(ref["adapters"]) and diff == 0.0, (case, diff, names[:2])
    pm = peft.PeftModel.from_pretrained(hf_model(root / case / "base"), str(root / case / "peft")).eval()
    with torch.no_grad():
        logits = pm(input_ids=ref["ids"]).logits
    assert torch.equal(logits, ref["logits32"]), (logits - ref["logits32"]).abs().max()


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("case", list(CKPT))
def test_hybrid_adapter_checkpoint_loads_at_another_tp(launched, case):
    """Megatron's distributed checkpoint of the adapters (in_proj_qkv's B stored as its q/k/v row blocks) saved at TP1
    loads at TP2 into exactly the adapters that were saved."""
    assert launched[1][(case, *CKPT[case][1], "ckpt")] == 0.0


MERGE_CASES = list(CASES_DEF) + [c for c, spec in HYBRID_DEF.items() if spec[5]]


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("case", MERGE_CASES)
def test_merged_export_matches_peft_merge(launched, case):
    if case in HYBRID_DEF:  # one stage holds every layer: the adapted projections are peft's adapted modules
        layout = HYBRID_DEF[case][4]
        diff = launched[1][(case, *layout, "merged")]
        assert diff <= 1e-6, f"{case}: merged export vs peft merge_and_unload max |Δ| = {diff:.3g}"
        n_lora, n_all = launched[1][(case, *layout, "only_lora", 0)]
        n_ref = len(torch.load(launched[0] / case / "ref.pt", weights_only=True)["adapters"]) // 2
        assert n_lora == n_ref < n_all, (case, n_lora, n_ref, n_all)
        return
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
