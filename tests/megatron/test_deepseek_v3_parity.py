"""DeepSeek-V3 (MLA with and without q_lora_rank, YaRN with mscale, interleaved rotary pairs, sigmoid router with
score-correction bias and group-limited top-k, routed scaling, an ungated shared expert, a dense first layer):
Megatron logits == transformers' ``DeepseekV3ForCausalLM`` (fp32, <= 1e-5) at TP1, TP2, EP2, PP2 and EP2×PP2
(the model without q_lora_rank at TP1, TP2 and EP2×PP2; the all-to-all dispatcher, and the allgather one at EP2); HF → Megatron(EP2×PP2) → HF is bit-exact per tensor; the checkpoint's
multi-token-prediction layer is never read (its tensors are not exported back). One 4-rank gloo launch."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_deepseek import make_tiny_deepseek_hf, reference_routing
from tests.helpers.tiny_moe_checkpoints import checkpoint_grads
from tests.megatron._deepseek_ranks import BIAS_SHIFT, DS_RUNS, deepseek_parity_rank
from tests.megatron._ranks import (
    assert_stages_export_the_checkpoint,
    write_reference_logits,
)

pytestmark = pytest.mark.multirank
TOL = 1e-5  # fp32: same maths, other summation order
CASES = {"q_lora": True, "no_q_lora_mtp": False}  # case -> q_lora_rank set; the second also holds an MTP layer
PARAMS = DS_RUNS


def _mtp_names(n_layers: int) -> list[str]:
    return [f"model.layers.{n_layers}.{s}" for s in ("eh_proj.weight", "enorm.weight", "hnorm.weight",
                                                       "self_attn.kv_b_proj.weight", "shared_head.norm.weight")]


def _add_mtp_layer(path: Path) -> None:
    """What a DeepSeek-V3 checkpoint stores after its decoder: ``model.layers.{num_hidden_layers}.*``."""
    tensors = load_file(str(path / "model.safetensors"))
    for name in _mtp_names(4):
        tensors[name] = torch.randn(8, 8)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _add_reference_routing(path: Path) -> None:
    """ref.pt gains transformers' expert choice of its ids (the "engine's", for replay) and how many
    token-layer choices the bias shift of the replay check changes (computed here from transformers)."""
    from transformers import AutoModelForCausalLM

    ref = torch.load(path / "ref.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    routed = reference_routing(model, ref["ids"])
    shifted = reference_routing(model, ref["ids"], BIAS_SHIFT)
    moe = [1, 2, 3]
    ref["routed"] = routed
    ref["flips"] = int((routed[:, :, moe] != shifted[:, :, moe]).any(-1).sum())
    torch.save(ref, path / "ref.pt")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_parity")
    gen = torch.Generator().manual_seed(0)
    for case, q_lora in CASES.items():
        write_reference_logits(make_tiny_deepseek_hf(root / case, seed=1, q_lora=q_lora), gen)
    _add_mtp_layer(root / "no_q_lora_mtp")
    _add_reference_routing(root / "q_lora")
    results = run_ranks(deepseek_parity_rank, 4, args=(str(root),), timeout_s=300,
                        init_process_group=False)
    merged: dict = {}
    for r in results:
        merged.update(r)
    for key in ("bias_update", "replay", "grads"):
        merged.pop(key, None)
        merged[key] = results[0][key]
    print("max |Δlogits|:", {k: f"{v:.2e}" for k, v in sorted(merged.items(), key=str) if not isinstance(v, dict)},
          "replay:", merged["replay"], "bias update:", merged["bias_update"])
    return root, merged


@pytest.mark.parametrize("case,dispatcher,layout", PARAMS,
                         ids=[f"{c}-{d}-tp{l[0]}pp{l[1]}ep{l[2]}" for c, d, l in PARAMS])
def test_deepseek_v3_logits_match_transformers(launched, case, dispatcher, layout):
    _, diffs = launched
    diff = diffs[(case, dispatcher, *layout[:3])]
    assert diff <= TOL, f"{case} {dispatcher} {layout}: max |Δlogits| = {diff:.3g} > {TOL}"


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_v3_roundtrip_ep2_pp2_bit_exact(launched, case):
    root, _ = launched
    src = root / case
    stage_dirs = [root / f"rt_{case}" / f"stage{s}" for s in range(2)]
    if case == "no_q_lora_mtp":  # compare against the checkpoint without its MTP layer, which nobody read
        tensors = load_file(str(src / "model.safetensors"))
        assert all(n in tensors for n in _mtp_names(4))
        src = root / "no_mtp"
        src.mkdir(exist_ok=True)
        save_file({n: t for n, t in tensors.items() if not n.startswith("model.layers.4.")},
                  str(src / "model.safetensors"), metadata={"format": "pt"})
    stages = assert_stages_export_the_checkpoint(src, stage_dirs)
    names = [n for st in stages for n in st.names()]
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names and "model.layers.0.mlp.gate_proj.weight" in names
    assert any(".experts.15." in n for n in names), "EP rank 1's experts missing from the export"
    assert any("q_a_proj" in n for n in names) is CASES[case]


def test_score_correction_bias_stays_frozen_in_training(launched):
    """RL keeps the checkpoint's e_score_correction_bias (docs/moe.md): after a training step's forward/backward,
    Megatron's expert-bias update leaves it bit-identical; Megatron's default rate would have moved every router's."""
    _, diffs = launched
    b = diffs["bias_update"]
    assert b["rate"] == 0.0 and b["routers"] == 3 and b["tokens_counted"] > 0, b
    assert b["frozen"] and b["moved_at_default_rate"] and b["fp32"], b


def test_routing_replay_gives_transformers_logits_under_another_own_choice(launched):
    """R3 with DeepSeek-V3's router: the trainer's score-correction bias shifted, its own choice differs from
    transformers' on many token-layers (counted here from transformers' router logits; mrl's
    moe/replay_mismatch counts the same ones); replaying transformers' ids restores transformers' logits."""
    root, diffs = launched
    r = diffs["replay"]
    flips = torch.load(root / "q_lora" / "ref.pt", weights_only=True)["flips"]
    assert r["own"] > 1e-2 and flips > 10, r
    assert r["replayed"] <= TOL, r
    assert r["mismatch"] == flips and r["compared"] == 3 * 4 * 16, (r, flips)


def _transformers_grads(path: Path, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """d(sum of logits)/d(weight) by transformers' autograd, under checkpoint names (its fused experts split per
    expert: gate_up_proj[e] = [gate_proj_e; up_proj_e], down_proj[e] = down_proj_e)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    model(ids).logits.sum().backward()
    return checkpoint_grads(model)


def test_gradients_match_transformers(launched):
    """Megatron's backward through MLA, the YaRN rotation, the sigmoid router (its weights carry the routed scaling)
    and the shared and routed experts = transformers' autograd, per HF tensor (TP1, fp32)."""
    root, diffs = launched
    got = diffs["grads"]
    want = _transformers_grads(root / "q_lora", torch.load(root / "q_lora" / "ref.pt", weights_only=True)["ids"])
    assert sorted(got) == sorted(want)
    # transformers' embedding has padding_idx = pad_token_id (0): that row gets no gradient there, Megatron's does
    for d in (got, want):
        d["model.embed_tokens.weight"] = d["model.embed_tokens.weight"][1:]
    worst = max(((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12)).item() for n in want)
    assert worst <= 1e-5, worst
    assert all(want[n].abs().max() > 0 for n in want if "router" in n or "mlp.gate.weight" in n)
