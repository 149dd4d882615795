"""`mrl from-verl`: verl launch scripts (fixtures in tests/config/verl_scripts/, written in the shape of verl's
examples/grpo_trainer, examples/ppo_trainer, recipe/dapo and the LoRA examples) become mrl YAMLs that `mrl plan`
accepts where the values allow; every key not carried over is named with the reason."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mrl.cli import EXIT_CONFIG, main
from mrl.config import load_config
from mrl.config.from_verl import (
    expand,
    logical_lines,
    overrides_from_script,
    translate,
    translate_overrides,
)

SCRIPTS = Path(__file__).parent / "verl_scripts"


def _from_verl(capsys: pytest.CaptureFixture[str], tmp_path: Path, script: str) -> tuple[dict, str, Path]:
    out = tmp_path / f"{script}.yaml"
    assert main(["from-verl", str(SCRIPTS / f"{script}.sh"), "-o", str(out)]) == 0
    return yaml.safe_load(out.read_text()), capsys.readouterr().err, out


def _has(d: dict, sub: dict) -> bool:
    return all(d.get(k) == v for k, v in sub.items())


def _plan(capsys: pytest.CaptureFixture[str], path: Path) -> tuple[int, str]:
    # as written: the translation says cluster.device=cuda (verl's scripts are GPU runs), so this CPU host plans it
    rc = main(["plan", str(path)])
    return rc, capsys.readouterr().err


def test_grpo_megatron(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg, err, out = _from_verl(capsys, tmp_path, "grpo_megatron")
    assert cfg["data"]["train_files"] == ["/data/gsm8k/train.parquet", "$HOME/corpora/math/train.parquet"]  # $VAR expanded
    assert cfg["actor"]["optim"] == {"lr": 1e-6, "lr_warmup_steps_ratio": 0.05, "lr_schedule": "cosine"}
    assert cfg["actor"]["megatron"] == {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    assert _has(cfg["rollout"], {"engine": "sglang", "engine_tp_size": 2, "n": 8, "max_response_length": 1536,
                                 "mem_fraction_static": 0.55, "placement": "colocated"})
    assert cfg["rollout"]["weight_sync"] == {"transport": "tensor"}
    assert cfg["cluster"] == {"n_gpus_per_node": 8, "nnodes": 1, "device": "cuda"} and cfg["trainer"]["logger"] == ["console"]
    text = out.read_text()
    assert "$HOME is not defined in the script" in text and "trainer.logger=[console,wandb]: mrl logs to console and mlflow only" in text
    assert "not mapped: data.truncation=error" in err
    # cosine with a warmup ratio and no total_training_steps: the length comes from the data, as in verl
    assert "verl derives the run's length" not in text
    rc, perr = _plan(capsys, out)
    assert rc == 0, perr


def test_ppo_with_critic_and_reward_model(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, err, out = _from_verl(capsys, tmp_path, "ppo_critic_rm")
    assert cfg["algorithm"] == {"adv_estimator": "gae", "gamma": 1.0, "lam": 0.95, "kl_ctrl": {"kl_coef": 0.002}}
    assert cfg["actor"]["clip_ratio_low"] == cfg["actor"]["clip_ratio_high"] == 0.25 and cfg["actor"]["ppo_epochs"] == 2
    assert cfg["critic"] == {"optim": {"lr": 2e-6}, "model_path": "Qwen/Qwen2.5-0.5B-Instruct",
                             "ppo_micro_batch_size_per_gpu": 4, "cliprange_value": 0.3}
    assert cfg["reward_model"] == {"enable": True, "model": {"path": "/models/rm-0.5b"}, "micro_batch_size_per_gpu": 16}
    assert cfg["reward"] == {"function": "reward_fns/judge.py:judge"}
    assert cfg["rollout"]["engine"] == "sglang" and "rollout.name=vllm: mrl's GPU engines are SGLang" in out.read_text()
    for key in ("trainer.some_future_key=7: no mrl equivalent known", "reward_model.max_length=1024",
                "actor_rollout_ref.actor.fsdp_config.param_offload=False: FSDP", "trainer.default_hdfs_dir"):
        assert f"not mapped: {key}" in err, key
    monkeypatch.chdir(tmp_path)  # the reward function's relative path
    (tmp_path / "reward_fns").mkdir()
    (tmp_path / "reward_fns" / "judge.py").write_text("def judge(data_source, solution_str, ground_truth, extra_info=None):\n"
                                                      "    return 0.0\n")
    rc, perr = _plan(capsys, out)
    assert rc == 0, perr


def test_dapo_recipe(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg, err, out = _from_verl(capsys, tmp_path, "dapo")
    assert _has(cfg["data"], {"max_prompt_length": 1024, "train_batch_size": 64, "gen_batch_size": 192,
                              "train_files": ["/shared/rl/dapo-17k.parquet"]})  # $((...)) and ${VAR:-default}
    assert cfg["rollout"]["max_response_length"] == 3072 and cfg["actor"]["ppo_max_token_len_per_gpu"] == 8192
    assert cfg["algorithm"]["filter_groups"] == {"enable": True, "metric": "acc", "max_num_gen_batches": 10}
    assert cfg["actor"]["clip_ratio_high"] == 0.28 and cfg["actor"]["optim"]["clip_grad"] == 1.0
    assert cfg["reward"]["overlong_buffer"] == {"enable": True, "len": 1024, "penalty_factor": 1.0}
    assert cfg["model"]["path"] == "/shared/rl/models/Qwen2.5-Math-1.5B"
    assert cfg["trainer"]["default_local_dir"] == "/shared/rl/ckpts/dapo_test/qwen-math-dapo"
    assert "not mapped: actor_rollout_ref.actor.ulysses_sequence_parallel_size=2" in err
    assert "not mapped: actor_rollout_ref.model.override_config.max_position_embeddings=32768" in err
    rc, perr = _plan(capsys, out)
    assert rc == 0, perr


def test_lora(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg, err, out = _from_verl(capsys, tmp_path, "grpo_lora")
    assert cfg["actor"]["lora"] == {"rank": 32, "alpha": 64, "target_modules": ["all-linear"]}
    assert "not mapped: actor_rollout_ref.rollout.layered_summon=True" in err
    rc, perr = _plan(capsys, out)
    assert rc == 0, perr
    assert load_config(str(out)).actor.lora.targets[0] == "q_proj"


def test_overrides_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["from-verl", "python3", "-m", "verl.trainer.main_ppo", "data.train_files=a.parquet",
            "actor_rollout_ref.actor.optim.lr=1e-6", "++trainer.n_gpus_per_node=2", "actor_rollout_ref.model.lora_rank=8",
            "actor_rollout_ref.model.target_modules=[q_proj,v_proj]"]
    assert main(argv) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["actor"]["optim"]["lr"] == 1e-6 and isinstance(cfg["actor"]["optim"]["lr"], float)
    assert cfg["cluster"]["n_gpus_per_node"] == 2 and cfg["data"]["train_files"] == ["a.parquet"]
    assert cfg["actor"]["lora"]["target_modules"] == ["q_proj", "v_proj"]


def test_target_modules_string_form_is_accepted_by_the_config(tmp_path: Path) -> None:
    t = load_config("mrl_configs/quickstart.yaml", ["actor.lora.rank=4", "actor.lora.target_modules=all-linear"])
    # every projection name mrl adapts; a model adapts those it has (the Gated DeltaNet ones only on a hybrid decoder)
    assert t.actor.lora.targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba",
                                    "out_proj")
    assert load_config("mrl_configs/quickstart.yaml", ["actor.lora.rank=4", "actor.lora.target_modules=q_proj"]
                       ).actor.lora.targets == ("q_proj",)


def test_shell_expansion() -> None:
    env = {"a": "3", "P": "/x"}
    undefined: set[str] = set()
    assert expand("$((a * 2 + 1)) ${P}/y ${Q:-\"$P/q\"} '$P' $@", env, undefined) == "7 /x/y /x/q '$P' "
    assert expand("$NOPE/z", env, undefined) == "$NOPE/z" and undefined == {"NOPE"}
    assert logical_lines("# c\npython3 a \\\n  b=1 \\\n  c=2\nx=1") == ["python3 a    b=1    c=2", "x=1"]


def test_errors_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["from-verl", str(tmp_path / "none.sh")]) == EXIT_CONFIG
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "x.sh").write_text("echo hello\n")
    assert main(["from-verl", str(tmp_path / "x.sh")]) == EXIT_CONFIG
    assert "no verl launch line found" in capsys.readouterr().err
    with pytest.raises(ValueError):
        overrides_from_script("ls\n")
    assert not translate_overrides(["just.a.flag"]).config
    assert translate(["unknown.key=1"]).unmapped[0][2].startswith("no mrl equivalent known")


def test_bash_arrays_and_megatron_lora_names() -> None:
    script = """
rank=16
MODEL=(
    actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B  # a comment
    # actor_rollout_ref.model.lora.dropout=0.05
    actor_rollout_ref.model.lora.rank=$rank
    actor_rollout_ref.model.lora.target_modules='["linear_qkv","linear_proj"]'
)
TRAINER=(trainer.nnodes=2 trainer.logger='["console","mlflow"]')
python3 -m verl.trainer.main_ppo --config-name='ppo_megatron_trainer.yaml' "${MODEL[@]}" "${TRAINER[@]}" "$@"
"""
    overrides, _ = overrides_from_script(script)
    assert overrides == ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B", "actor_rollout_ref.model.lora.rank=16",
                         'actor_rollout_ref.model.lora.target_modules=["linear_qkv","linear_proj"]', "trainer.nnodes=2",
                         'trainer.logger=["console","mlflow"]']
    t = translate_overrides(overrides)
    assert t.get("actor.lora.rank") == 16
    assert t.get("actor.lora.target_modules") == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert t.get("trainer.logger") == ["console", "mlflow"] and t.get("rollout.host") == "0.0.0.0"


def test_explicit_clip_bounds_win_over_clip_ratio_in_either_order() -> None:
    a = translate_overrides([f"actor_rollout_ref.actor.{k}" for k in ("clip_ratio_high=0.28", "clip_ratio=0.2")])
    b = translate_overrides([f"actor_rollout_ref.actor.{k}" for k in ("clip_ratio=0.2", "clip_ratio_high=0.28")])
    for t in (a, b):
        assert (t.get("actor.clip_ratio_low"), t.get("actor.clip_ratio_high")) == (0.2, 0.28)


def test_context_parallel_is_carried_over_and_ulysses_points_to_it(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: Path) -> None:
    """verl's megatron.context_parallel_size maps to mrl's (with a note on what mrl's CP runs on) and `mrl plan`
    accepts the YAML; Ulysses SP (FSDP's) is not mapped and its line tells the user to set context_parallel_size."""
    script = (SCRIPTS / "grpo_megatron.sh").read_text().replace(
        "    actor_rollout_ref.actor.use_kl_loss=True \\\n",
        "    actor_rollout_ref.actor.use_kl_loss=True \\\n"
        "    actor_rollout_ref.actor.megatron.context_parallel_size=2 \\\n"
        "    actor_rollout_ref.ref.megatron.context_parallel_size=2 \\\n"
        "    actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 \\\n")
    assert "context_parallel_size=2" in script
    (tmp_path / "cp.sh").write_text(script)
    out = tmp_path / "cp.yaml"
    assert main(["from-verl", str(tmp_path / "cp.sh"), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    cfg = yaml.safe_load(out.read_text())
    assert cfg["actor"]["megatron"]["context_parallel_size"] == 2 and cfg["ref"]["megatron"]["context_parallel_size"] == 2
    notes = translate_overrides(["actor_rollout_ref.actor.megatron.context_parallel_size=2"]).notes
    assert any("actor.megatron.context_parallel_size=2" in n and "sdpa" in n for n in notes), notes
    ulysses = [ln for ln in err.splitlines() if "ulysses_sequence_parallel_size=2" in ln]
    assert len(ulysses) == 1 and "set actor.megatron.context_parallel_size" in ulysses[0], ulysses
    rc, perr = _plan(capsys, out)
    assert rc == 0, perr
    assert translate_overrides(["actor_rollout_ref.actor.megatron.context_parallel_size=1"]).get(
        "actor.megatron.context_parallel_size") == 1


def test_use_remove_padding_becomes_mrls_packed_rows() -> None:
    """verl's use_remove_padding=True -> auto (packed wherever the attention is sdpa, said in a note); False stays."""
    on = translate_overrides(["actor_rollout_ref.model.use_remove_padding=True"])
    assert on.get("actor.use_remove_padding") == "auto" and not on.unmapped
    assert any("use_remove_padding" in n and "auto" in n for n in on.notes)
    off = translate_overrides(["actor_rollout_ref.model.use_remove_padding=False"])
    assert off.get("actor.use_remove_padding") is False


def test_readme_dapo_line_then_plan_on_any_host(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's `mrl from-verl tests/config/verl_scripts/dapo.sh -o dapo.yaml`, then the natural `mrl plan dapo.yaml`
    with no override: a verl script is a GPU run, so the YAML says cluster.device: cuda (with a note) and the plan
    does not depend on this host having a GPU (issue 45 item 5)."""
    monkeypatch.chdir(tmp_path)
    script = Path(__file__).resolve().parents[2] / "tests/config/verl_scripts/dapo.sh"
    assert main(["from-verl", str(script), "-o", "dapo.yaml"]) == 0
    capsys.readouterr()
    text = (tmp_path / "dapo.yaml").read_text()
    assert yaml.safe_load(text)["cluster"]["device"] == "cuda"
    assert "# note: cluster.device=cuda: a verl launch is a GPU run" in text and "cluster.device=cpu" in text
    monkeypatch.setattr("mrl.config.validate._gpu_visible", lambda: False)  # what a CPU host shows
    assert main(["plan", "dapo.yaml"]) == 0, capsys.readouterr().err
    assert "needs CUDA devices" not in capsys.readouterr().err


def test_trainer_device_is_carried_over() -> None:
    """verl's trainer.device: cuda/cpu set cluster.device (no note); npu is reported (mrl has no NPU support)."""
    assert translate_overrides(["data.seed=1", "trainer.device=cpu"]).get("cluster.device") == "cpu"
    gpu = translate_overrides(["data.seed=1", "trainer.device=cuda"])
    assert gpu.get("cluster.device") == "cuda" and not [n for n in gpu.notes if "cluster.device" in n]
    npu = translate_overrides(["data.seed=1", "trainer.device=npu"])
    assert npu.get("cluster.device") is None and npu.unmapped[0][0] == "trainer.device"
    assert "CUDA GPUs" in npu.unmapped[0][2]


def test_deepseek_v3_uneven_pipeline_stages_are_carried_over(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    """verl's DeepSeek-V3 671B examples split the 61 layers over PP16 as 4 + 14 x 4 + 1 with Megatron's
    num_layers_in_first/last_pipeline_stage (a `+...override_transformer_config.` key); mrl's layout keys take
    them, the plan's layer split accepts them and prints the stages; other TransformerConfig overrides stay
    listed as not mapped."""
    from mrl.config import check_config

    cfg, err, out = _from_verl(capsys, tmp_path, "deepseek671b_megatron")
    assert cfg["actor"]["megatron"] == {"pipeline_model_parallel_size": 16, "expert_model_parallel_size": 16,
                                        "expert_tensor_parallel_size": 1, "num_layers_in_first_pipeline_stage": 4,
                                        "num_layers_in_last_pipeline_stage": 1}
    assert "override_transformer_config.recompute_method=uniform: Megatron TransformerConfig overrides other" in err
    errors = check_config(load_config(str(out), check=False))[0]
    assert not [e for e in errors if "layers" in e], errors
    # without the uneven keys the same layout is refused, naming a split that works
    loaded = yaml.safe_load(out.read_text())
    for k in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
        del loaded["actor"]["megatron"][k]
    (tmp_path / "even.yaml").write_text(yaml.safe_dump(loaded))
    errors = check_config(load_config(str(tmp_path / "even.yaml"), check=False))[0]
    split = [e for e in errors if e.startswith("actor.megatron: the 61 layers")]
    assert len(split) == 1 and "fix: choose PP dividing 61 or actor.megatron.num_layers_in_last_pipeline_stage=1" \
        in split[0], errors
