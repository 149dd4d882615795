"""MoE layout and settings are checked before anything starts (mrl/config/validate_moe.py), and `mrl plan`
prints the expert grid and total vs active parameters."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mrl.config import check_config, load_config
from mrl.config.hf import bundled_hub_shape, shape_from_dict
from mrl.config.plan_report import build_report, format_report

MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 300, "hidden_size": 64,
       "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 16, "max_position_embeddings": 256, "num_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 48, "norm_topk_prob": True, "tie_word_embeddings": False}


@pytest.fixture()
def moe_overrides(base_overrides: list[str], tmp_path: Path) -> list[str]:
    d = tmp_path / "moe"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(MOE))
    return [o for o in base_overrides if not o.startswith("model.path=")] + [f"model.path={d}"]


def _errors(overrides: list[str]) -> list[str]:
    return check_config(load_config(None, overrides, check=False))[0]


CASES = [  # (overrides, substrings of one error)
    (["actor.megatron.expert_model_parallel_size=3"], ["expert_model_parallel_size=3", "divide"]),
    (["actor.megatron.expert_model_parallel_size=8"], ["ETP*EP*PP", "does not divide the 4 devices"]),
    (["actor.megatron.expert_model_parallel_size=2", "actor.moe.token_dispatcher=allgather"],
     ["token_dispatcher=allgather", "fix: actor.moe.token_dispatcher=alltoall"]),
    (["actor.megatron.tensor_model_parallel_size=2"], ["Mixture-of-Experts", "sequence_parallel=true"]),
    (["actor.megatron.expert_tensor_parallel_size=3"], ["ETP*EP*PP = 3*1*1", "does not divide"]),
    (["actor.megatron.expert_tensor_parallel_size=5"], ["expert_tensor_parallel_size=5", "does not divide the expert MLP"]),
    (["actor.moe.routing_replay=rollout", "actor.shared_prefix=true"], ["routing_replay=rollout", "shared_prefix=false"]),
    (["actor.lora.rank=8", "actor.lora.target_modules=[gate_proj,down_proj]"],
     ["actor.lora.target_modules", "routed experts, which take no adapters"]),
    (["actor.moe.routing_replay=old", "actor.shared_prefix=true"], ["routing_replay=old", "shared_prefix=false"]),
    # R2 records in the old-log-prob forward, which the on-policy shortcut skips
    (["actor.moe.routing_replay=old", "actor.on_policy_shortcut=true"],
     ["actor.on_policy_shortcut=true", "actor.moe.routing_replay=old", "old-log-prob forward"]),
]


@pytest.mark.parametrize("extra,must", CASES, ids=[c[1][0] for c in CASES])
def test_bad_moe_layouts_are_refused_with_the_key(moe_overrides, extra, must):
    errors = _errors(moe_overrides + extra)
    assert any(all(s in e for s in must) for e in errors), errors
    assert all("fix" in e for e in errors), errors


def test_good_moe_layouts_pass(moe_overrides):
    for extra in ([], ["actor.megatron.expert_model_parallel_size=4", "actor.moe.routing_replay=rollout"],
                  ["actor.megatron.expert_model_parallel_size=2", "actor.megatron.pipeline_model_parallel_size=2",
                   "actor.ppo_micro_batch_size_per_gpu=4"],
                  # CP x EP (issue 52; tests/workers/test_context_parallel.py): the EP pairs are the CP pairs
                  ["actor.megatron.expert_model_parallel_size=2", "actor.megatron.context_parallel_size=2",
                   "actor.moe.routing_replay=rollout", "actor.moe.aux_loss_coef=0.01"]):
        assert _errors(moe_overrides + extra) == [], extra


def test_plan_prints_cp_and_the_expert_grid_folding_cp(moe_overrides):
    """Megatron's expert grid has no CP axis: EDP = devices / (ETP·EP·PP) takes the CP ranks (4 / 2 = 2)."""
    cfg = load_config(None, moe_overrides + ["actor.megatron.expert_model_parallel_size=2",
                                             "actor.megatron.context_parallel_size=2"])
    text = format_report(cfg, build_report(cfg))
    assert "CP=2 DP=2" in text and "EP=2 ETP=1 EDP=2" in text, text


def test_moe_settings_on_a_dense_model_are_refused(base_overrides):
    errors = _errors(base_overrides + ["actor.moe.routing_replay=rollout"])
    assert any("actor.moe.routing_replay" in e and "dense" in e for e in errors), errors


def test_plan_prints_expert_grid_and_active_params(moe_overrides):
    cfg = load_config(None, moe_overrides + ["actor.megatron.expert_model_parallel_size=2"])
    text = format_report(cfg, build_report(cfg))
    assert "EP=2 ETP=1 EDP=2" in text and "8 experts, top-2" in text and "active per token" in text
    shape = shape_from_dict(MOE)
    total, active = shape.param_count(), shape.param_count(active=True)
    # 4 layers x (8 - 2) experts x 3 x 64 x 48 parameters are not used by any one token
    assert total - active == 4 * 6 * 3 * 64 * 48


def test_bundled_hub_shape_of_the_gpu_recipe():
    s = bundled_hub_shape("Qwen/Qwen3-30B-A3B")
    assert s is not None and s.num_experts == 128 and s.experts_per_token == 8
    assert round(s.param_count() / 1e9, 1) == 30.5 and 3.3 <= s.param_count(active=True) / 1e9 < 3.4  # "30B-A3B"
    assert bundled_hub_shape("Qwen/not-a-bundled-model") is None


def test_plan_prints_the_routing_replay_mode(moe_overrides):
    """R2 (old) needs the old-log-prob forward: the shortcut's null resolves to off and the plan says so."""
    from mrl.config.run_plan import on_policy_blockers, on_policy_shortcut

    texts = {}
    for mode in ("none", "rollout", "old"):
        cfg = load_config(None, moe_overrides + [f"actor.moe.routing_replay={mode}"])
        texts[mode] = format_report(cfg, build_report(cfg))
        assert f"(actor.moe.routing_replay={mode})" in texts[mode]
        assert cfg.actor.moe.engine_routed_experts is (mode == "rollout")  # R2 asks nothing of the engines
    assert "routing replay: R2, the old-log-prob forward's expert choice recorded" in texts["old"]
    assert "routing replay: R3" in texts["rollout"] and "routing replay: off" in texts["none"]
    old = load_config(None, moe_overrides + ["actor.moe.routing_replay=old"])
    blockers = lambda c: [b for b in on_policy_blockers(c) if "routing_replay" in b]
    assert blockers(old) and not blockers(load_config(None, moe_overrides)) and not on_policy_shortcut(old)
    assert "old-log-prob forward: recomputed before the update" in texts["old"]


def test_lora_on_moe_says_what_it_adapts(moe_overrides, tmp_path):
    """Adapters on attention, dense MLP layers and shared experts; the routed experts and the router stay frozen."""
    cfg = load_config(None, moe_overrides + ["actor.lora.rank=8"])
    errors, notes = check_config(cfg)
    assert errors == [] and any("adapters on the attention;" in n and "routed experts" in n for n in notes), notes
    d = tmp_path / "mixed"  # a shared expert and one dense layer: MLP-only targets have somewhere to go
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**MOE, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                                               "shared_expert_intermediate_size": 32, "mlp_only_layers": [0]}))
    over = [o for o in moe_overrides if not o.startswith("model.path=")] + [f"model.path={d}"]
    errors, notes = check_config(load_config(None, over + ["actor.lora.rank=8", "actor.lora.target_modules=[gate_proj]"],
                                             check=False))
    assert errors == [] and any("adapters on the 1 dense MLP layer(s) and the shared experts;" in n for n in notes), notes


GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 300, "hidden_size": 64,
           "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "max_position_embeddings": 256, "num_local_experts": 8, "num_experts_per_tok": 2,
           "sliding_window": 8, "tie_word_embeddings": False}


@pytest.mark.parametrize("extra_cfg,extra,must", [
    ({}, ["actor.megatron.tensor_model_parallel_size=2", "actor.megatron.sequence_parallel=true"],
     ["expert_tensor_parallel_size=2", "experts have biases", "fix: actor.megatron.expert_tensor_parallel_size=1"]),
    ({"quantization_config": {"quant_method": "mxfp4"}}, [], ["mxfp4", "Mxfp4Config(dequantize=True)"]),
])
def test_gpt_oss_refusals_before_anything_starts(base_overrides, tmp_path, extra_cfg, extra, must):
    d = tmp_path / "gpt_oss"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(GPT_OSS | extra_cfg))
    overrides = [o for o in base_overrides if not o.startswith("model.path=")] + [f"model.path={d}"]
    errors = _errors(overrides + extra)
    assert any(all(s in e for s in must) for e in errors), errors
    ok = _errors(overrides + ["actor.megatron.tensor_model_parallel_size=2", "actor.megatron.sequence_parallel=true",
                              "actor.megatron.expert_tensor_parallel_size=1"])
    assert not any("experts have biases" in e for e in ok), ok


@pytest.mark.parametrize("hub,recipe,total,active", [
    ("lmsys/gpt-oss-20b-bf16", "gpt-oss-20b_grpo_1x8_ep8.yaml", 20.9, 4.19),
    ("lmsys/gpt-oss-120b-bf16", "gpt-oss-120b_grpo_6x8_ep32.yaml", 116.8, 5.71),
])
def test_gpt_oss_recipes_plan_from_their_bundled_shapes(hub, recipe, total, active):
    """The bundled config.json is transformers' model: its parameters, counted by transformers on the meta device,
    are the plan's up to the biases and sinks the plan leaves out (< 0.1 %); the recipe plans with no error."""
    import torch
    import transformers as tf

    from mrl.config.hf import HUB_SHAPES

    s = bundled_hub_shape(hub)
    assert s is not None and s.model_type == "gpt_oss" and s.experts_per_token == 4
    assert round(s.param_count() / 1e9, 1) == total and round(s.param_count(active=True) / 1e9, 2) == active
    raw = json.loads((HUB_SHAPES / f"{hub.replace('/', '--')}.json").read_text())
    assert "quantization_config" not in raw
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(**raw))
    exact = sum(p.numel() for p in model.parameters())
    assert 0 <= exact - s.param_count() < 1e-3 * exact
    cfg = load_config(Path(__file__).resolve().parents[2] / "mrl_configs" / recipe)
    assert check_config(cfg)[0] == []
def test_plan_notes_of_a_deepseek_v3_checkpoint(base_overrides, tmp_path):
    """mrl plan says what RL does with DeepSeek-V3's score-correction bias (frozen) and that the checkpoint's
    multi-token-prediction layer is skipped; its parameter count is MLA's."""
    from tests.helpers.tiny_deepseek import deepseek_config

    d = tmp_path / "ds"
    d.mkdir()
    raw = {**deepseek_config().to_dict(), "architectures": ["DeepseekV3ForCausalLM"], "num_nextn_predict_layers": 1}
    (d / "config.json").write_text(json.dumps(raw))
    overrides = [o for o in base_overrides if not o.startswith("model.path=")] + [f"model.path={d}"]
    cfg = load_config(None, overrides)
    text = format_report(cfg, build_report(cfg))
    assert "multi-latent attention runs on Megatron's local spec with torch SDPA" in text, text
    errors = _errors(overrides + ["actor.megatron.attention_backend=local"])
    assert any("attention_backend=local" in e and "multi-latent" in e and "fix" in e for e in errors), errors
    errors = _errors(overrides + ["actor.lora.rank=8"])
    assert any("actor.lora" in e and "multi-latent" in e and "rank=0" in e for e in errors), errors
    assert "score-correction bias (e_score_correction_bias): loaded and frozen during RL" in text, text
    assert "multi-token-prediction layers (1: model.layers.4) in the checkpoint are skipped on load" in text, text
    raw["num_nextn_predict_layers"] = 0
    (d / "config.json").write_text(json.dumps(raw))
    assert "multi-token-prediction" not in format_report(cfg, build_report(cfg))
    # CP (issue 52): MLA under CP plans (tests/workers/test_context_parallel.py runs it) and prints CP
    cp = load_config(None, overrides + ["actor.megatron.context_parallel_size=2"])
    assert check_config(cp)[0] == [] and "CP=2 DP=2" in format_report(cp, build_report(cp))


def test_bundled_deepseek_v3_and_kimi_k2_shapes_count_their_published_sizes():
    """mrl's copies of the two config.json files give the sizes their model cards state: DeepSeek-V3 671B with 37B
    active, Kimi-K2 1T with 32B active (MTP layers not counted: mrl does not build them)."""
    ds, kimi = bundled_hub_shape("deepseek-ai/DeepSeek-V3"), bundled_hub_shape("moonshotai/Kimi-K2-Instruct")
    assert ds is not None and kimi is not None and ds.mla is not None and kimi.mla is not None
    assert round(ds.param_count() / 1e9) == 671 and 37 <= ds.param_count(active=True) / 1e9 < 38
    assert 1.02 <= kimi.param_count() / 1e12 < 1.04 and 32 <= kimi.param_count(active=True) / 1e9 < 33
    assert (ds.moe_layers, kimi.moe_layers) == (58, 60) and not ds.shared_expert_gate


@pytest.mark.parametrize("recipe,stages,engines,actor_gib", [
    ("deepseek-v3_grpo_20x8_pp16_ep8.yaml", "4 x15, 1", "2 x sglang engine(s), tp=16 over 2 nodes each", 107.48),
    ("kimi-k2_grpo_40x8_pp16_ep16.yaml", "4 x15, 1", "2 x sglang engine(s), tp=32 over 4 nodes each", 81.98),
])
def test_deepseek_v3_and_kimi_k2_recipes_plan_with_uneven_stages_and_engines_over_nodes(recipe, stages, engines,
                                                                                       actor_gib):
    """The 61 layers split 4 + 14 x 4 + 1 over PP16 (verl's DeepSeek-V3 split), the bf16 weights served by engines
    spanning nodes (1.34 TB / 2.05 TB: more than one node of 8 H200 holds), and the actor's memory per GPU with the
    experts' Adam states whole (EDP1) fits a 141 GB H200 before activations."""
    cfg = load_config(Path(__file__).resolve().parents[2] / "mrl_configs" / recipe)
    assert check_config(cfg)[0] == []
    report = build_report(cfg)
    text = format_report(cfg, report)
    assert f"layers per stage: {stages}" in text and engines in text and "EDP=1" in text, text
    # the figure docs/moe.md's recipe table cites (pinned so the docs stay true; the estimate's own arithmetic is
    # checked against independent counts in tests/config/test_pipeline_split.py)
    assert round(report.memory["actor"].total / 2**30, 2) == actor_gib
    assert max(report.device_total().values()) < 131 * 2**30  # 141 GB = 131 GiB per H200


def test_gpt_oss_plans_under_context_parallelism(base_overrides, tmp_path):
    """Issue 52: gpt-oss (sinks, sliding windows, MoE) at CP2 x EP2 plans (tests/workers/test_context_parallel.py
    runs it at CP2 against CP1)."""
    d = tmp_path / "gpt_oss"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(GPT_OSS))
    overrides = [o for o in base_overrides if not o.startswith("model.path=")] + [f"model.path={d}"]
    cfg = load_config(None, overrides + ["actor.megatron.context_parallel_size=2",
                                         "actor.megatron.expert_model_parallel_size=2"], check=False)
    assert check_config(cfg)[0] == []
