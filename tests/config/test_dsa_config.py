"""DeepSeek-V3.2 / GLM-5 (DeepSeek sparse attention) at plan time: ``mrl plan`` says what RL does with the indexer
(frozen; its KL warm-up loss not built) and counts its parameters as transformers does; the layouts its indexer
cannot run (context parallelism, shared-prefix rows) are refused in one line naming the key and the fix; the
refusals of the family name the config.json key."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from mrl.config import check_config, load_config
from mrl.config.auto import resolve_shared_prefix
from mrl.config.hf import shape_from_dict
from mrl.config.plan_report import build_report, format_report
from mrl.families import family_of
from tests.helpers.tiny_dsa import dsa_config

ARCH = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}


def _raw(kind: str) -> dict:
    return {**dsa_config(kind).to_dict(), "architectures": [ARCH[kind]]}


@pytest.fixture(params=list(ARCH))
def dsa_overrides(request, base_overrides: list[str], tmp_path: Path) -> list[str]:
    d = tmp_path / request.param
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_raw(request.param)))
    return [o for o in base_overrides if not o.startswith("model.path=")] + [f"model.path={d}"]


def _errors(overrides: list[str]) -> list[str]:
    return check_config(load_config(None, overrides, check=False))[0]


def test_plan_says_the_indexer_is_frozen_and_its_loss_not_built(dsa_overrides):
    cfg = load_config(None, dsa_overrides)
    text = format_report(cfg, build_report(cfg))
    assert "lightning indexer (self_attn.indexer.*) picks the top 4 earlier tokens per query" in text, text
    assert "frozen during RL (no gradient, not in the optimizer" in text and "KL indexer warm-up" in text, text
    assert "score-correction bias (e_score_correction_bias): loaded and frozen during RL" in text, text


@pytest.mark.parametrize("kind", list(ARCH))
def test_parameter_count_is_transformers(kind):
    """The plan's count (MLA + the indexer's wq_b, wk, k_norm, weights_proj + experts) == transformers' own."""
    import torch
    import transformers as tf

    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(dsa_config(kind))
    assert shape_from_dict(_raw(kind)).param_count() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("extra,must", [
    (["actor.megatron.context_parallel_size=2", "actor.use_remove_padding=true"],
     ["context_parallel_size", "DeepSeek sparse attention"]),
    (["actor.shared_prefix=true"], ["actor.shared_prefix=true", "DeepSeek sparse attention", "fix"]),
    (["actor.recompute_granularity=selective"], ["actor.recompute_granularity=selective", "fix"]),
], ids=["context_parallel", "shared_prefix", "selective_recompute"])
def test_layouts_the_indexer_cannot_run_are_refused(dsa_overrides, extra, must):
    errors = _errors(dsa_overrides + extra)
    assert any(all(s in e for s in must) for e in errors), errors


def test_shared_prefix_auto_stays_off(dsa_overrides):
    choice = resolve_shared_prefix(load_config(None, dsa_overrides + ["data.max_prompt_length=64"]), "cpu")
    assert choice.value is False and "sparse-attention indexer" in choice.why


@pytest.mark.parametrize("kind,change,match", [
    ("deepseek_v32", {"q_lora_rank": None}, "q_lora_rank is null"),
    ("deepseek_v32", {"index_head_dim": 2}, "index_head_dim=2"),
    ("glm_moe_dsa", {"indexer_types": ["full", "shared", "full"]}, "indexer_types"),
])
def test_family_refusals_name_the_key(kind, change, match):
    """(A config.json as mrl reads it: transformers' strict config class would refuse a null q_lora_rank itself.)"""
    cfg = SimpleNamespace(**{**_raw(kind), **change})
    with pytest.raises(ValueError, match=match):
        family_of(cfg).check(cfg)
