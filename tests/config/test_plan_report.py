"""`mrl plan`'s report: numbers for three layouts, memory estimates from hand arithmetic, parameter counts vs transformers."""
from __future__ import annotations

from pathlib import Path

import pytest

from mrl.config import load_config
from mrl.config.hf import shape_from_dict
from mrl.config.plan_report import build_report, format_report, padded_vocab, plan_text
from tests.config.conftest import write_hf_config

# Published architectures (HF config.json values); official parameter counts 494,032,768 and 7,615,616,512.
QWEN25_05B = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
              "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768, "tie_word_embeddings": True}
QWEN25_7B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
             "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768, "tie_word_embeddings": False}


def _qwen2_layer(h: int, heads: int, kv: int, inter: int) -> int:
    d = h // heads
    return h * heads * d * 2 + 2 * h * kv * d + heads * d + 2 * kv * d + 3 * h * inter + 2 * h


def test_param_count_matches_published_counts() -> None:
    assert shape_from_dict(QWEN25_05B).param_count() == 494_032_768
    assert shape_from_dict(QWEN25_7B).param_count() == 7_615_616_512


@pytest.mark.slow  # imports torch + transformers (cheap inside the full suite, ~10 s alone)
def test_param_count_matches_transformers_models() -> None:
    import torch
    import transformers as tf

    from tests.helpers.tiny_models import hf_config

    for family in ("llama", "qwen2", "qwen3", "mistral"):
        with torch.device("meta"):  # shapes only: no weights are allocated or initialised
            model = tf.AutoModelForCausalLM.from_config(hf_config(family))
        expected = sum(p.numel() for p in model.parameters())
        assert shape_from_dict(hf_config(family).to_dict()).param_count() == expected, family


def test_plan_quickstart_cpu_layout(tiny_model: Path, train_file: Path) -> None:
    cfg = load_config("mrl_configs/quickstart.yaml", [f"model.path={tiny_model}", f"data.train_files=[{train_file}]",
                                                      f"data.val_files=[{train_file}]"])
    plan = build_report(cfg)
    assert (plan.samples_per_step, plan.mini_batches_per_step, plan.optimizer_steps_per_step) == (512, 1, 1)
    assert (plan.samples_per_dp_rank, plan.micro_batches_per_dp_rank, plan.micro_batches_is_bound) == (256, 4, False)
    assert {k: (v.count, v.dp, v.colocated) for k, v in plan.roles.items()} == {
        "actor": (2, 2, False), "ref": (2, 2, True), "rollout": (2, 0, True)}
    assert plan.num_engines == 2
    p = 167_744 + 64 * (384 - 300)  # tied tiny qwen2, vocab padded 300 -> 384 (multiple of 128*TP1)
    assert plan.param_count == 167_744
    # float32: weights 4 + fp32 grads 4 + Adam m,v 8 sharded over DP=2
    assert plan.memory["actor"].weights == p * 4 and plan.memory["actor"].grads == p * 4
    assert plan.memory["actor"].optimizer == p * 8 // 2
    assert plan.memory["ref"].total == p * 4
    assert plan.memory["rollout"].total == 167_744 * 4
    assert plan.device_total() == {"actor": p * 4 * 2 + p * 4 + p * 4 + 167_744 * 4}
    assert all("no weights here (yet)" in n for n in plan.notes)  # the fixture is config.json only


def test_plan_single_node_8gpu_layout(tmp_path: Path, train_file: Path) -> None:
    model = write_hf_config(tmp_path / "q05", QWEN25_05B)
    cfg = load_config("mrl_configs/qwen2.5-0.5b_grpo_1x8.yaml",
                      [f"model.path={model}", f"data.train_files=[{train_file}]", f"data.val_files=[{train_file}]"])
    plan = build_report(cfg)
    assert (plan.samples_per_step, plan.mini_batches_per_step, plan.optimizer_steps_per_step) == (2048, 4, 4)
    assert (plan.samples_per_dp_rank, plan.micro_batches_per_dp_rank) == (64, 4)
    assert plan.roles["actor"].dp == 8 and plan.num_engines == 8
    assert padded_vocab(151936, 128, 1) == 151936
    p = 494_032_768
    # bf16: 2 (weights) + 4 (fp32 grads) + 12 (fp32 master + Adam) / DP 8
    assert plan.memory["actor"].total == p * 2 + p * 4 + p * 12 // 8
    assert plan.memory["ref"].total == p * 2
    assert plan.memory["rollout"].total == p * 2


def test_plan_two_node_tp2_pp2_layout(tmp_path: Path, train_file: Path) -> None:
    model = write_hf_config(tmp_path / "q7", QWEN25_7B)
    cfg = load_config("mrl_configs/qwen2.5-7b_grpo_2x8_tp2.yaml",
                      [f"model.path={model}", f"data.train_files=[{train_file}]", f"data.val_files=[{train_file}]",
                       "actor.megatron.pipeline_model_parallel_size=2", "actor.ppo_micro_batch_size_per_gpu=8",
                       "actor.ppo_epochs=2", "rollout.placement=colocated", "rollout.num_engines=null"],
                      check=False)  # the layout math only: colocated engines on 2 CUDA nodes have no transport yet
    plan = build_report(cfg)
    # 512 prompts x 5 = 2560 samples; 4 mini-batches of 640 samples; DP = 16 / (TP2*PP2) = 4 -> 160 per rank
    assert (plan.samples_per_step, plan.mini_batches_per_step, plan.optimizer_steps_per_step) == (2560, 4, 8)
    assert (plan.roles["actor"].dp, plan.samples_per_dp_rank, plan.micro_batches_per_dp_rank) == (4, 160, 20)
    # the colocated reference runs in the actor's model chunks: the actor's layout (ref.megatron is for separate)
    assert plan.roles["ref"].dp == plan.roles["actor"].dp == 4 and plan.num_engines == 8
    h, v = 3584, 152064  # 152064 is a multiple of 128*2: no padding
    layer = _qwen2_layer(h, 28, 4, 18944)
    last_stage = (14 * layer + v * h) / 2 + h  # 14 layers, output layer (TP-sharded), final norm
    p_actor = int(last_stage)
    assert plan.memory["actor"].weights == p_actor * 2
    assert plan.memory["actor"].optimizer == int(p_actor * 12 / 4)
    assert plan.memory["ref"].weights == p_actor * 2  # colocated: the actor's chunks and layout
    assert plan.memory["rollout"].weights == 7_615_616_512 * 2 // 2
    text = format_report(cfg, plan)
    assert "actor          16 devices [node0:0-7, node1:0-7] TP=2 PP=2 CP=1 DP=4" in text


def test_separate_roles_are_laid_out_after_the_actor(tmp_path: Path, train_file: Path) -> None:
    model = write_hf_config(tmp_path / "q7", QWEN25_7B)
    cfg = load_config("mrl_configs/qwen2.5-7b_grpo_2x8_tp2.yaml",
                      [f"model.path={model}", f"data.train_files=[{train_file}]", f"data.val_files=[{train_file}]",
                       "ref.placement=separate", "ref.num_devices=2", "ref.offload=false", "rollout.placement=separate", "rollout.num_engines=3",
                       "data.train_batch_size=160", "actor.ppo_mini_batch_size=32", "actor.ppo_micro_batch_size_per_gpu=2"],
                      check=False)  # the layout only
    plan = build_report(cfg)
    lay = plan.roles
    assert (lay["actor"].first, lay["actor"].count, lay["actor"].dp) == (0, 8, 4)
    assert (lay["ref"].first, lay["ref"].count, lay["ref"].dp) == (8, 2, 1)
    assert (lay["rollout"].first, lay["rollout"].count) == (10, 6)
    assert lay["rollout"].nodes(8) == "node1:2-7"
    totals = plan.device_total()
    assert set(totals) == {"actor", "ref", "rollout"}


def test_a_separate_reward_model_is_laid_out_after_the_other_roles(tmp_path: Path, train_file: Path) -> None:
    model = write_hf_config(tmp_path / "q7", QWEN25_7B)
    rm = write_hf_config(tmp_path / "rm", {**QWEN25_05B, "architectures": ["Qwen2ForSequenceClassification"]})
    cfg = load_config("mrl_configs/qwen2.5-7b_grpo_2x8_tp2.yaml",
                      [f"model.path={model}", f"data.train_files=[{train_file}]", f"data.val_files=[{train_file}]",
                       "ref.placement=separate", "ref.num_devices=2", "ref.offload=false", "rollout.placement=separate",
                       "rollout.num_engines=3", "reward_model.enable=true", f"reward_model.model.path={rm}",
                       "reward_model.placement=separate", "reward_model.num_devices=2",
                       "reward_model.megatron.pipeline_model_parallel_size=2"],
                      check=False)  # the layout only
    plan = build_report(cfg)
    lay = plan.roles
    assert (lay["actor"].first, lay["actor"].count, lay["actor"].dp) == (0, 6, 3)
    assert (lay["ref"].first, lay["rollout"].first, lay["rollout"].count) == (6, 8, 6)
    r = lay["reward_model"]
    assert (r.first, r.count, r.dp, r.colocated, r.nodes(8)) == (14, 2, 1, False, "node1:6-7")
    assert (r.parallel.tensor_model_parallel_size, r.parallel.pipeline_model_parallel_size) == (1, 2)
    # bf16 on GPUs; PP2 over 24 layers: the last stage (12 layers + norm + [1, H] head) vs the first (embedding + 12)
    h, layer = 896, _qwen2_layer(896, 14, 2, 4864)
    assert plan.memory["reward_model"].weights == int(max(151936 * h + 12 * layer, 12 * layer + 2 * h)) * 2
    assert set(plan.device_total()) == {"actor", "ref", "rollout", "reward_model"}
    assert "reward_model    2 devices [node1:6-7] TP=1 PP=2 CP=1 DP=1; owns these devices" in format_report(cfg, plan)


def test_dynamic_bsz_reports_an_upper_bound(tiny_model: Path, train_file: Path) -> None:
    cfg = load_config("mrl_configs/quickstart.yaml", [f"model.path={tiny_model}", f"data.train_files=[{train_file}]",
                                                      "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=200"])
    plan = build_report(cfg)
    assert plan.micro_batches_is_bound and plan.micro_batches_per_dp_rank == 93  # ceil(256 * (64 + 8) / 200)


def test_empty_yaml_section_means_defaults(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("actor:\ncritic:\n  optim:\n")
    cfg = load_config(f, ["actor.optim.lr=3.0e-6"], check=False)
    assert cfg.actor.optim.lr == 3.0e-6 and cfg.critic.optim.lr == 1e-5


def test_plan_text_has_resolved_config_and_plan(tiny_model: Path, train_file: Path) -> None:
    import yaml

    cfg = load_config("mrl_configs/quickstart.yaml", [f"model.path={tiny_model}", f"data.train_files=[{train_file}]",
                                                      f"data.val_files=[{train_file}]"])
    text = plan_text(cfg)
    head, _, tail = text.partition("\nplan:\n")
    assert yaml.safe_load(head)["rollout"]["n"] == 16
    assert "samples per step: 512" in tail and "memory per device" in tail


QWEN25_3B = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
             "num_attention_heads": 16, "num_key_value_heads": 2, "max_position_embeddings": 32768, "tie_word_embeddings": True}


def test_lora_recipe_plan_shows_memory_saved(tmp_path: Path, train_file: Path) -> None:
    """The GPU LoRA recipe at Qwen2.5-3B: adapter count = peft's trainable count on the same architecture
    (built on the meta device), only adapters get grads and Adam state, the colocated reference costs 0."""
    import peft
    import torch
    import transformers as tf

    model = write_hf_config(tmp_path / "q3b", QWEN25_3B)
    cfg = load_config("mrl_configs/qwen2.5-3b_gsm8k_grpo_lora.yaml",
                      [f"model.path={model}", f"data.train_files=[{train_file}]", f"data.val_files=[{train_file}]"])
    plan = build_report(cfg)
    with torch.device("meta"):
        hf = tf.AutoModelForCausalLM.from_config(tf.Qwen2Config(**{k: v for k, v in QWEN25_3B.items() if k != "model_type"}))
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=64, lora_alpha=32, target_modules="all-linear"))
    a = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    assert a == 36 * 64 * (2 * 2048 + 2 * (2048 + 256) + 2 * 2048 + 3 * (2048 + 11008)) == 119_734_272
    p = 3_085_938_688  # Qwen2.5-3B (tied), vocab 151936 already a multiple of 128
    assert plan.param_count == p
    # bf16 weights (+ adapters) + fp32 grads and fp32 master + Adam (12 B) / DP 8 of the adapters only
    assert plan.memory["actor"].total == (p + a) * 2 + a * 4 + a * 12 // 8
    assert plan.full_finetune_actor.total == p * 2 + p * 4 + p * 12 // 8
    assert plan.memory["ref"].total == 0
    text = format_report(cfg, plan)
    saved = (plan.full_finetune_actor.total - plan.memory["actor"].total) / 1024**3
    assert f"saves {saved:.2f} GiB per actor device" in text and "LoRA rank 64 (7 target projections)" in text
    print(text.split("memory per device")[1])
