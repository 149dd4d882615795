"""Megatron MoE GPTModel logits == transformers logits (fp32) for Qwen3-MoE, Qwen2-MoE (shared
expert with its gate, un-normalised top-k), Mixtral and GLM-4.5 (sigmoid router with its score-correction bias,
partial RoPE, ungated shared expert, a dense first layer) at TP2, EP2, PP2, EP2×PP2 and TP2 with EP2 folded over
it, with both token dispatchers; models mixing dense and MoE layers (Qwen3-MoE with ``mlp_only_layers=[0]``,
Qwen2-MoE with ``decoder_sparse_step=2``, GLM-4.5 without q/k norm and qkv bias, two dense layers and
group-limited routing: Megatron ``moe_layer_freq``) at TP1, EP2, PP2 and EP2×PP2; gpt-oss (attention sinks,
alternating windows, YaRN, biased router and clamped-SwiGLU experts stored fused) at TP1, TP2, EP2, PP2, EP2×PP2
and TP2×EP2 (ETP1: Megatron's expert biases) with both dispatchers, and its gradients at TP1 vs transformers' for
every tensor, and in bf16 (replaying the fp32 routing) as close to the fp32 truth as transformers' bf16 is; a GLM
router's expert_bias unchanged by a train step's ``finalize_model_grads``;
HF → Megatron(EP2×PP2) → HF is bit-exact per tensor for all of them. One 4-rank gloo launch covers all of it."""
from __future__ import annotations

import pytest
import torch

from mrl.families import FAMILIES as FAMILY_OF
from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import hf_config, make_tiny_hf
from tests.megatron._moe_ranks import (
    ETP1_LAYOUTS,
    MIXED_LAYOUTS,
    MOE_LAYOUTS,
    moe_parity_rank,
)
from tests.megatron._ranks import (
    assert_stages_export_the_checkpoint,
    write_reference_logits,
)

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"]
# GLM-4.5 (sigmoid router with its score-correction bias, routed_scaling_factor, partial RoPE, qkv bias, q/k norm,
# ungated shared expert) with its first layer dense, as GLM-4.5-Air's first_k_dense_replace=1
FAMILY_OVERRIDES = {"glm4_moe": {"first_k_dense_replace": 1}}
DISPATCHERS = ["alltoall", "allgather"]
TOL = 1e-5  # fp32: same maths, other summation order (expert order, TP reductions)
PARAMS = [(f, d, lay) for f in FAMILIES for d in DISPATCHERS for lay in MOE_LAYOUTS]
# case -> (family, overrides): some layers dense. Qwen3-MoE: layer 0 (pp stage 0 mixes a dense and an MoE
# layer); Qwen2-MoE: layers 0 and 2 (each pp stage starts dense; its dense layers have no shared expert).
MIXED = {
    "qwen3_moe_mlp_only_0": ("qwen3_moe", {"mlp_only_layers": [0]}),
    "qwen2_moe_sparse_step_2": ("qwen2_moe", {"decoder_sparse_step": 2}),
    # GLM-4.5-Air's attention (no q/k norm) without qkv bias, two dense first layers (pp stage 0 all dense), and
    # group-limited routing (2 groups of 2 experts, top-2 inside the best group)
    "glm4_moe_no_qk_norm": ("glm4_moe", {"use_qk_norm": False, "attention_bias": False, "first_k_dense_replace": 2,
                                         "n_group": 2, "topk_group": 1}),
}
FROZEN_BIAS = ["glm4_moe"]  # sigmoid routers whose expert_bias must survive a train step (rate 0)
MIXED_PARAMS = [(c, DISPATCHERS[0], lay) for c in MIXED for lay in MIXED_LAYOUTS]
BIASED = ["gpt_oss"]  # experts with biases: ETP1 layouts
BIASED_PARAMS = [(c, d, lay) for c in BIASED for d in DISPATCHERS for lay in ETP1_LAYOUTS]
BF16_BATCH = (8, 32)  # the bf16 check's ids: enough tokens for a stable mean error
# mrl's bf16 error over transformers' (both replaying the fp32 routing): the mean is stable (Megatron adds the
# attention biases after the GEMM, one more bf16 rounding than nn.Linear), the max is one token's rounding
BF16_MEAN_RATIO, BF16_MAX_RATIO = 1.1, 2.0


def _write_reference_grads(path, gen: torch.Generator) -> None:
    """``path/grads.pt``: transformers' fp32 gradients of ``sum(logits · w)`` (w random) for every parameter."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.load(path / "ref.pt", weights_only=True)["ids"]
    w = torch.randn(*ids.shape, model.config.vocab_size, generator=gen) / ids.numel()
    (model(ids).logits * w).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    torch.save({"ids": ids, "w": w, "grads": grads}, path / "grads.pt")


def _write_bf16_reference(path, gen: torch.Generator) -> None:
    """``path/bf16.pt``: a batch of BF16_BATCH ids; transformers' fp32 logits of it (the truth) and its expert ids
    ``routed`` [B, S, layers, K] (the top-k of each router's logits); transformers' bf16 logits with each router held
    to those ids (its own bf16 logits there, softmax over them: what mrl's replay computes), the error mrl's bf16
    is held to."""
    import types

    import torch.nn.functional as F
    import transformers as tf

    ids = torch.randint(0, tf.AutoConfig.from_pretrained(path).vocab_size, BF16_BATCH, generator=gen)
    truth_model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = truth_model(ids, output_router_logits=True)
    k = truth_model.config.num_experts_per_tok
    routed = torch.stack([lg.topk(k, dim=-1).indices.view(*ids.shape, k) for lg in out.router_logits], dim=2)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()

    def held_router(i: int):
        def forward(self, hidden):  # GptOssTopKRouter.forward with the top-k taken among the truth's experts only
            logits = F.linear(hidden, self.weight, self.bias)
            allowed = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, routed[:, :, i].reshape(-1, k), True)
            top, idx = logits.masked_fill(~allowed, float("-inf")).topk(k, dim=-1)
            return logits, F.softmax(top, dim=1, dtype=top.dtype), idx
        return forward

    for i, layer in enumerate(model.model.layers):
        layer.mlp.router.forward = types.MethodType(held_router(i), layer.mlp.router)
    with torch.no_grad():
        hf_bf16 = model(ids).logits.float()
    torch.save({"ids": ids, "routed": routed, "truth": out.logits, "hf_bf16": hf_bf16}, path / "bf16.pt")


def write_engine_routing(path, gen: torch.Generator) -> None:
    """``path/replay.pt``: an "engine" = the checkpoint's model with other score-correction biases (they only choose
    the experts); its expert ids of ref.pt's tokens, by the independent formula top-k(sigmoid(router logits) + bias)
    (one expert group), and its logits."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.load(path / "ref.pt", weights_only=True)["ids"]
    moe = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        for i in moe:
            bias = model.model.layers[i].mlp.gate.e_score_correction_bias
            bias.copy_(0.2 * torch.randn(bias.shape, generator=gen))
        out = model(ids, output_router_logits=True)
    routed = torch.zeros(*ids.shape, len(model.model.layers), k, dtype=torch.long)
    for i, logits in zip(moe, out.router_logits):
        scores = torch.sigmoid(logits.float()) + model.model.layers[i].mlp.gate.e_score_correction_bias
        routed[:, :, i] = torch.topk(scores, k, dim=-1).indices.view(*ids.shape, k)
    torch.save({"routed": routed, "logits": out.logits}, path / "replay.pt")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_parity")
    gen = torch.Generator().manual_seed(0)
    for fam in FAMILIES:
        write_reference_logits(make_tiny_hf(root / fam, fam, **FAMILY_OVERRIDES.get(fam, {})), gen)
    for case in FROZEN_BIAS:
        write_engine_routing(root / case, gen)
    for case, (fam, overrides) in MIXED.items():
        write_reference_logits(make_tiny_hf(root / case, fam, **overrides), gen)
    for fam in BIASED:
        write_reference_logits(make_tiny_hf(root / fam, fam), gen)
        _write_reference_grads(root / fam, gen)
        _write_bf16_reference(root / fam, gen)
    results = run_ranks(moe_parity_rank, 4, args=(str(root), FAMILIES, DISPATCHERS, list(MIXED), BIASED, FROZEN_BIAS),
                        timeout_s=420, init_process_group=False)
    merged: dict = {}
    for r in results:
        merged.update(r)
    print("max |Δlogits|:", {k: f"{v:.2e}" for k, v in sorted(merged.items(), key=str)})
    return root, merged


@pytest.mark.multirank
@pytest.mark.parametrize("family,dispatcher,layout", PARAMS,
                         ids=[f"{f}-{d}-tp{l[0]}pp{l[1]}ep{l[2]}etp{l[3]}" for f, d, l in PARAMS])
def test_moe_logits_match_transformers(launched, family, dispatcher, layout):
    _, diffs = launched
    diff = diffs[(family, dispatcher, *layout[:4])]
    assert diff <= TOL, f"{family} {dispatcher} {layout}: max |Δlogits| = {diff:.3g} > {TOL}"


@pytest.mark.multirank
@pytest.mark.parametrize("case,dispatcher,layout", MIXED_PARAMS,
                         ids=[f"{c}-{d}-tp{l[0]}pp{l[1]}ep{l[2]}etp{l[3]}" for c, d, l in MIXED_PARAMS])
def test_mixed_dense_moe_logits_match_transformers(launched, case, dispatcher, layout):
    _, diffs = launched
    diff = diffs[(case, dispatcher, *layout[:4])]
    assert diff <= TOL, f"{case} {dispatcher} {layout}: max |Δlogits| = {diff:.3g} > {TOL}"


@pytest.mark.multirank
@pytest.mark.parametrize("case,dispatcher,layout", BIASED_PARAMS,
                         ids=[f"{c}-{d}-tp{l[0]}pp{l[1]}ep{l[2]}etp{l[3]}" for c, d, l in BIASED_PARAMS])
def test_gpt_oss_logits_match_transformers(launched, case, dispatcher, layout):
    _, diffs = launched
    diff = diffs[(case, dispatcher, *layout[:4])]
    assert diff <= TOL, f"{case} {dispatcher} {layout}: max |Δlogits| = {diff:.3g} > {TOL}"


@pytest.mark.multirank
@pytest.mark.parametrize("case", BIASED)
def test_gpt_oss_gradients_match_transformers(launched, case):
    """Every parameter's gradient (sinks, biases, router bias, fused experts through the clamps) at TP1, in HF
    layout, vs transformers' autograd: max |Δ| relative to the largest gradient."""
    _, diffs = launched
    assert diffs[(case, "grads")] <= TOL, f"{case}: gradients differ by {diffs[(case, 'grads')]:.3g} (relative)"


@pytest.mark.multirank
@pytest.mark.parametrize("case", BIASED)
def test_gpt_oss_bf16_is_as_close_to_fp32_as_transformers_bf16(launched, case):
    """mrl's bf16 model (TP1, sinks, windows, biases, clamped experts) against transformers' fp32 logits, both bf16
    models replaying the fp32 model's expert ids: mrl's error is transformers' own bf16 error (mean within
    BF16_MEAN_RATIO of it, max within BF16_MAX_RATIO). Without replay a near-tie that rounding flips (in either
    model) gives isolated O(0.3) logit differences, which is all that set gpt-oss's bf16 apart (docs/moe.md)."""
    root, diffs = launched
    ref = torch.load(root / case / "bf16.pt", weights_only=True)
    hf = (ref["hf_bf16"] - ref["truth"]).abs()
    mrl_max, mrl_mean = diffs[(case, "bf16", "max")], diffs[(case, "bf16", "mean")]
    msg = (f"{case} bf16 vs fp32 truth: mrl max/mean {mrl_max:.4f}/{mrl_mean:.5f}, transformers bf16 "
           f"{float(hf.max()):.4f}/{float(hf.mean()):.5f}")
    assert mrl_mean <= BF16_MEAN_RATIO * float(hf.mean()) and mrl_max <= BF16_MAX_RATIO * float(hf.max()), msg


@pytest.mark.multirank
def test_gpt_oss_roundtrip_ep2_pp2_bit_exact(launched):
    """The fused [E, ...] expert tensors come back whole: each stage gathers its layers' experts over EP."""
    root, _ = launched
    stages = assert_stages_export_the_checkpoint(root / "gpt_oss", [root / "rt_gpt_oss" / f"stage{s}" for s in range(2)])
    fused = [st.get(n) for st in stages for n in st.names() if n.endswith("mlp.experts.gate_up_proj")]
    assert len(fused) == 4 and all(t.shape[0] == 4 for t in fused)


@pytest.mark.multirank
@pytest.mark.parametrize("family", FAMILIES + list(MIXED))
def test_moe_roundtrip_ep2_pp2_bit_exact(launched, family):
    root, _ = launched
    stages = assert_stages_export_the_checkpoint(root / family, [root / f"rt_{family}" / f"stage{s}" for s in range(2)])
    names = [n for st in stages for n in st.names()]
    assert any(".experts.3." in n for n in names), "EP rank 1's experts missing from the export"
    if family in MIXED:  # the dense layers' MLP went through Megatron's linear_fc1/fc2 and back
        fam, overrides = MIXED[family]
        dense = [i for i, moe in enumerate(FAMILY_OF[fam].moe_layers(hf_config(fam, **overrides))) if not moe]
        assert dense and all(f"model.layers.{i}.mlp.gate_proj.weight" in names for i in dense)
        assert not any(f"model.layers.{i}.mlp.experts." in n for i in dense for n in names)


@pytest.mark.multirank
@pytest.mark.parametrize("case", FROZEN_BIAS)
def test_sigmoid_router_expert_bias_stays_frozen_through_a_train_step(launched, case):
    """mrl keeps the score-correction bias a frozen checkpoint weight (moe_router_bias_update_rate=0):
    Megatron's finalize_model_grads runs its aux-loss-free update on counted tokens and moves nothing."""
    _, diffs = launched
    assert diffs[("expert_bias", case)] == 0.0, f"{case}: expert_bias moved by {diffs[('expert_bias', case)]:.3g}"


@pytest.mark.multirank
@pytest.mark.parametrize("case", FROZEN_BIAS)
def test_routing_replay_gives_the_engines_logits(launched, case):
    """R3 with a sigmoid router: the engine's routers carry other score-correction biases, so they choose other
    experts; replaying its ids (mrl's router probes, Megatron's RouterReplay) at EP2 gives the engine's logits."""
    _, diffs = launched
    assert diffs[("replay", case)] <= TOL, f"{case}: replayed logits differ from the engine's by {diffs[('replay', case)]:.3g}"
    assert diffs[("own", case)] > 1e-3, "the engine's biases changed no routing: the test cannot tell replay from none"


@pytest.mark.multirank
@pytest.mark.parametrize("case", FROZEN_BIAS)
def test_lora_on_glm_adapts_attention_dense_mlp_and_shared_experts(launched, case):
    """LoRA (all-linear) on GLM-4.5 at EP2: mrl adapts attention, the dense layer's MLP and the ungated shared
    experts (HF ``mlp.shared_experts.*``, width n_shared_experts x moe_intermediate_size), not the routed experts or
    the router; its merged export equals peft's merge_and_unload of mrl's exported adapters on the attention.
    peft (0.21, transformers 5) reads gate/up/down_proj targets of glm4_moe as the routed experts' fused tensors
    and leaves the MLP adapters out (docs/moe.md), so only the attention has peft as the oracle."""
    import peft
    import transformers as tf

    from mrl.megatron.lora_io import write_peft

    root, _ = launched
    path = root / case
    got = torch.load(path / "lora.pt", weights_only=True)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    base = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    base_sd = {n: t.clone() for n, t in base.state_dict().items()}
    layers = base.config.num_hidden_layers
    attn = {f"model.layers.{i}.self_attn.{p}.weight" for i in range(layers) for p in targets[:4]}
    mlp = {f"model.layers.0.mlp.{p}.weight" for p in targets[4:]}  # the dense layer
    mlp |= {f"model.layers.{i}.mlp.shared_experts.{p}.weight" for i in range(1, layers) for p in targets[4:]}
    changed = {n for n, t in got["merged"].items() if n in base_sd and not torch.equal(t, base_sd[n])}
    assert changed == attn | mlp, changed ^ (attn | mlp)
    assert got["peft"]["base_model.model.model.layers.1.mlp.shared_experts.down_proj.lora_A.weight"].shape == (4, 48)
    write_peft(root / f"peft_{case}", {n: t for n, t in got["peft"].items() if "self_attn" in n},
               {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": targets[:4]}, base_model=str(path))
    merged = peft.PeftModel.from_pretrained(base, str(root / f"peft_{case}")).merge_and_unload().state_dict()
    assert {n for n, t in merged.items() if not torch.equal(t, base_sd[n])} == attn
    diff = max(float((got["merged"][n] - merged[n]).abs().max()) for n in attn)
    assert diff <= 1e-6, f"mrl's merged export vs peft's merge: {diff:.3g}"
