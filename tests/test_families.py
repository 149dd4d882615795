"""The family registry (mrl/families/): every family module declares every piece mrl asks of a family,
the registry is exactly the modules' union, and the package stays torch-free (``mrl plan`` and the
rollout engine import it)."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import mrl.families as registry
from mrl.families import (
    FAMILIES,
    REFUSED_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    Family,
    MoE,
    family_of,
)
from mrl.families.rules import LAYER_KINDS, SPLITS, Rule
from tests.helpers.tiny_models import hf_config

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mrl" / "families"
NOT_FAMILIES = {"__init__", "base", "rules", "refused", "views"}  # the registry and the shared pieces
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in NOT_FAMILIES)


def test_every_family_module_is_registered():
    assert sorted(registry._MODULES) == MODULES
    assert sorted(FAMILIES) == sorted(importlib.import_module(f"mrl.families.{m}").FAMILY.name for m in MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_family_module_declares_every_piece(module):
    mod = importlib.import_module(f"mrl.families.{module}")
    assert mod.__doc__ and len(mod.__doc__.strip()) > 40, f"{module}: a docstring saying what it declares"
    fam = mod.FAMILY
    assert isinstance(fam, Family) and FAMILIES[fam.name] is fam
    # a family whose released checkpoints wrap the decoder (a vision tower beside it) owns that architecture too
    # (carried: ``wrapped``; built and trained: ``vision``, which names transformers' tower class and its mRoPE kind)
    wraps = bool(fam.wrapped or fam.vision)
    assert fam.architectures and all(a.endswith("ForCausalLM") or (wraps and a.endswith("ForConditionalGeneration"))
                                     for a in fam.architectures)
    if fam.vision is not None:
        v = fam.vision
        # the tower is built, never also carried (Qwen3.5 still carries its mtp.* layers)
        assert v.mrope in ("sections", "interleaved") and not any(v.prefix.startswith(w) for w in fam.wrapped)
        tower = importlib.import_module(f"transformers.models.{v.module}.modeling_{v.module}")
        assert hasattr(tower, v.model_class) and hasattr(
            importlib.import_module(f"transformers.models.{v.module}.configuration_{v.module}"), v.config_class)
    assert not set(fam.architectures) & set(REFUSED_ARCHITECTURES)
    for flag in (fam.qkv_bias, fam.qk_norm, fam.sliding_window, fam.engine_refuses_sliding_window):
        assert isinstance(flag, bool)
    assert callable(fam.refuse)
    # weight rules: well formed, the model-level ones, and one per declared config fact
    rules = fam.weight_rules
    assert rules and all(isinstance(r, Rule) and r.split in SPLITS and r.scope in ("model", "layer") for r in rules)
    assert all(r.layers in LAYER_KINDS and (r.scope == "layer" or r.layers == "all") for r in rules)
    mcore = [r.mcore for r in rules]
    assert len(mcore) == len(set(mcore)), f"{module}: duplicate Megatron name"
    hf = [n for r in rules for n in r.hf]
    assert len(hf) == len(set(hf)), f"{module}: duplicate HF name"
    attention = (("self_attention.linear_kv_down_proj.weight", "self_attention.linear_kv_up_proj.weight")
                 if fam.is_mla else ("self_attention.linear_qkv.weight",))
    for name in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight",
                 "self_attention.linear_proj.weight", *attention):
        assert name in mcore, f"{module}: no rule for {name}"
    assert ("self_attention.linear_qkv.bias" in mcore) is fam.qkv_bias
    # MLA's q_layernorm is its query-latent norm (q_a_layernorm), not a per-head q/k norm
    assert ("self_attention.q_layernorm.weight" in mcore) is (fam.qk_norm or fam.is_mla)
    experts = [r for r in rules if r.expert]
    if fam.moe is None:
        assert not experts and "mlp.linear_fc1.weight" in mcore and "mlp.router.weight" not in mcore
        assert all(r.layers == "all" for r in rules)
    else:
        assert isinstance(fam.moe, MoE) and "mlp.router.weight" in mcore
        names = fam.moe.expert_names
        if fam.moe.fused_experts:  # one HF tensor per layer holds every expert (no {e}); weights and biases
            assert all("{j}" in r.mcore and r.fused and not any("{e}" in n for n in r.hf) for r in experts)
            assert len(experts) == (4 if fam.moe.expert_linear_bias else 2)
            assert len(names) == 3 and all(f".{fam.moe.block}.experts.{n}" in " ".join(hf) for n in names)
        else:
            assert all("{j}" in r.mcore and all("{e}" in n for n in r.hf) for r in experts) and len(experts) == 2
            assert not any(r.fused for r in rules) and not fam.moe.expert_linear_bias
            assert len(names) == 3 and all(f".{fam.moe.block}.experts.{{e}}.{n}.weight" in " ".join(hf) for n in names)
        assert f".{fam.moe.block}.{fam.moe.router}.weight" in " ".join(hf)
        for fn in (fam.moe.expert_ffn_size, fam.moe.norm_topk, fam.moe.shared_expert_size, fam.moe.refuse,
                   fam.moe.layers):
            assert callable(fn)
        # the MLP's rules say which layers hold them: router/experts/shared expert on MoE layers only, a dense
        # MLP (a family whose config can make layers dense) on dense layers only; the tiny configs are all-MoE
        assert all(r.layers == ("dense" if r.mcore.startswith("mlp.linear_fc") else "moe")
                   for r in rules if r.mcore.startswith("mlp."))
        assert fam.moe.layers(hf_config(fam.name)) == [1] * hf_config(fam.name).num_hidden_layers
        has_shared = any(r.mcore.startswith("mlp.shared_experts.") for r in rules)
        assert has_shared is bool(fam.moe.shared_expert_size(hf_config(fam.name)))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_config_kwargs_and_layer_spec_needs(name):
    """Each family has a tiny config in tests/helpers/tiny_models.py (its tests build on it), and its
    declarations give the TransformerConfig keywords and layer-spec needs the provider uses."""
    fam, cfg = FAMILIES[name], hf_config(name)
    assert family_of(cfg) is fam  # by architectures
    cfg.architectures = None
    assert family_of(cfg) is fam  # a config built in code: by model_type
    fam.check(cfg)
    kw = fam.transformer_kwargs(cfg, ep=2, etp=1)
    assert kw["add_qkv_bias"] is fam.qkv_bias and kw["qk_layernorm"] is fam.qk_norm
    assert ("num_moe_experts" in kw) is fam.is_moe
    spec = fam.layer_spec_kwargs(cfg)
    assert spec["qk_layernorm"] is fam.qk_norm and (spec["num_experts"] is not None) is fam.is_moe
    assert spec["multi_latent_attention"] is fam.is_mla and ("kv_lora_rank" in kw) is fam.is_mla
    if fam.sliding_window:
        cfg.sliding_window = 5
        assert fam.transformer_kwargs(cfg)["window_size"] == (4, 0)


def test_supported_architectures_are_the_union_of_the_modules():
    owned = [a for m in MODULES for a in importlib.import_module(f"mrl.families.{m}").FAMILY.architectures]
    assert len(owned) == len(set(owned)), "an architecture owned by two families"
    assert set(SUPPORTED_ARCHITECTURES) == set(owned)
    assert all(arch in FAMILIES[fam].architectures for arch, fam in SUPPORTED_ARCHITECTURES.items())


def test_the_family_package_imports_without_torch():
    probe = ("import sys, mrl.families; "
             "print(sorted(m for m in ('torch', 'megatron', 'transformers', 'mrl.megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["[]"], out.stdout + out.stderr
