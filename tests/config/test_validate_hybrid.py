"""A hybrid-attention model (Qwen3.5's vision-language release, tiny) in ``mrl plan``: the quickstart recipe plans
(shared-prefix rows resolved off, packed rows on, the Gated DeltaNet kernel named), and what would split or branch a
sequence and the te/local backends are refused in one line naming the key and the fix, before anything starts; LoRA
plans with peft's own adapter count for the gated attention and Gated DeltaNet projections, and a target name the
model lacks is refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mrl.config import load_config
from mrl.config.loader import ConfigError
from tests.helpers.tiny_qwen3_5 import make_tiny_qwen3_5_hf

RECIPE = Path(__file__).resolve().parents[2] / "mrl_configs" / "quickstart_qwen3_5.yaml"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> list[str]:
    """The overrides pointing the recipe at a tiny Qwen3.5 and a one-row prompt file."""
    from tests.helpers.tiny_tokenizer import save_tiny_tokenizer

    root = tmp_path_factory.mktemp("q35")
    path = make_tiny_qwen3_5_hf(root / "m")
    save_tiny_tokenizer(path)
    data = root / "p.jsonl"
    data.write_text(json.dumps({"prompt": "1 + 2 =", "reward_model": {"ground_truth": "3"}}) + "\n")
    return [f"model.path={path}", f"data.train_files=[{data}]", f"data.val_files=[{data}]"]


def _errors(model: list[str], *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        load_config(RECIPE, [*model, *overrides])
    return ei.value.errors


def test_the_hybrid_recipe_plans_without_shared_prefix(model: list[str]) -> None:
    from mrl.config.auto import resolve_shared_prefix

    cfg = load_config(RECIPE, model)
    choice = resolve_shared_prefix(cfg, "cpu")
    assert choice.value is False and "Gated DeltaNet" in choice.why


@pytest.mark.parametrize("override,key", [
    ("actor.shared_prefix=true", "actor.shared_prefix=true"),
    ("actor.megatron.attention_backend=local", "actor.megatron.attention_backend=local"),
    ("actor.megatron.context_parallel_size=2", "actor.megatron.context_parallel_size=2"),
])
def test_what_breaks_the_recurrence_is_refused_by_key(model: list[str], override: str, key: str) -> None:
    errors = _errors(model, override)
    assert any(e.startswith(key) and "fix:" in e for e in errors), errors


def test_lora_plans_with_peft_adapter_count(model: list[str]) -> None:
    """all-linear on the hybrid decoder: the plan's adapter parameters (TP1, one stage) = peft's trainable count on the
    transformers model with the names mrl writes to adapter_config.json (the vision tower has none of them)."""
    import peft
    import torch
    import transformers as tf

    from mrl.config.plan_report import build_report, format_report

    cfg = load_config(RECIPE, [*model, "actor.lora.rank=4"])
    plan = build_report(cfg)
    path = model[0].split("=", 1)[1]
    with torch.device("meta"):
        hf = tf.Qwen3_5ForConditionalGeneration(tf.AutoConfig.from_pretrained(path))
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=list(plan.lora_targets)))
    adapters = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    assert plan.memory["actor"].grads == 4 * adapters  # fp32 grads of the adapters only
    assert plan.lora_targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                 "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    assert "LoRA rank 4 (12 target projections)" in format_report(cfg, plan)
    assert any(n.startswith("actor.lora on a hybrid decoder: adapters on q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
                            "down_proj,in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj") for n in plan.notes), plan.notes


def test_a_target_the_model_lacks_is_refused(model: list[str]) -> None:
    errors = _errors(model, "actor.lora.rank=8", "actor.lora.target_modules=[q_proj,in_proj_qkvz]")
    assert any(e.startswith("actor.lora.target_modules=['q_proj', 'in_proj_qkvz'] names in_proj_qkvz") and
               "in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj" in e and "fix:" in e for e in errors), errors
