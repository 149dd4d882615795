"""reward_model: a causal LM is refused as reward model at plan time; a classifier passes with a note;
placement=separate is planned on devices of its own, its layout checked against the RM's own config.json."""
from __future__ import annotations

import pytest

from mrl.config import ConfigError, check_config, load_config
from tests.config.conftest import TINY_QWEN2, write_hf_config


def test_causal_lm_refused_classifier_accepted(base_overrides, tiny_model, tmp_path) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(None, base_overrides + ["reward_model.enable=true", f"reward_model.model.path={tiny_model}"])
    assert any("reward_model.model.path" in e and "not a *ForSequenceClassification" in e for e in ei.value.errors)
    rm = write_hf_config(tmp_path / "rm", {**TINY_QWEN2, "architectures": ["Qwen2ForSequenceClassification"]})
    cfg = load_config(None, base_overrides + ["reward_model.enable=true", f"reward_model.model.path={rm}"])
    errors, notes = check_config(cfg)
    assert errors == [] and any("reward_model.combine=rm" in n for n in notes)
    assert any("reward_model: colocated with the actor" in n for n in notes)
    cfg = load_config(None, base_overrides + ["reward_model.enable=true", f"reward_model.model.path={rm}",
                                              "reward_model.combine=rule+rm"])
    errors, notes = check_config(cfg)
    assert errors == [] and not any("combine" in n for n in notes)


def _errors(overrides: list[str]) -> list[str]:
    try:
        return check_config(load_config(None, overrides))[0]
    except ConfigError as e:
        return e.errors


def test_rm_tokenizer_placement_and_vocab_checked_at_plan_time(base_overrides, tiny_model, tmp_path) -> None:
    from tests.helpers.tiny_tokenizer import save_other_tokenizer, save_tiny_tokenizer

    cls = {**TINY_QWEN2, "architectures": ["Qwen2ForSequenceClassification"]}
    same = write_hf_config(tmp_path / "same", cls)
    other = write_hf_config(tmp_path / "other", {**cls, "vocab_size": 260})
    save_other_tokenizer(other)  # its own tokenizer with a chat template
    plain = write_hf_config(tmp_path / "plain", {**cls, "vocab_size": 260})
    save_tiny_tokenizer(plain)  # a tokenizer without a chat template
    rm = [*base_overrides, "reward_model.enable=true"]
    assert _errors([*rm, f"reward_model.model.path={same}"]) == []
    # another vocabulary cannot read the actor's ids: the fix names input_tokenizer = the actor's tokenizer
    e = _errors([*rm, f"reward_model.model.path={other}"])
    assert len(e) == 1 and "vocab_size 260, the actor's model 300" in e[0] and \
        f"reward_model.model.input_tokenizer={tiny_model}" in e[0], e
    ok = [*rm, f"reward_model.model.path={other}", f"reward_model.model.input_tokenizer={tiny_model}"]
    assert _errors(ok) == []
    notes = check_config(load_config(None, [*ok, "reward_model.max_length=128"]))[1]
    assert any("re-rendered with the RM's chat template" in n and "at most 128 tokens" in n for n in notes)
    e = _errors([*rm, f"reward_model.model.path={other}", "reward_model.model.input_tokenizer=/elsewhere"])
    assert any("input_tokenizer='/elsewhere' is not the actor's tokenizer" in x for x in e), e
    e = _errors([*rm, f"reward_model.model.path={plain}", f"reward_model.model.input_tokenizer={tiny_model}"])
    assert any("has no chat template" in x for x in e), e
    e = _errors([*rm, f"reward_model.model.path={same}", "reward_model.max_length=64"])
    assert any("reward_model.max_length=64 is set but only bounds re-rendered inputs" in x for x in e), e
    notes = check_config(load_config(None, [*rm, f"reward_model.model.path={same}", "reward_model.offload=true"]))[1]
    assert any("offloaded to host memory outside phase rm_score" in n for n in notes)


_CLS = {**TINY_QWEN2, "architectures": ["Qwen2ForSequenceClassification"]}


def test_separate_rm_is_valid_and_planned_on_its_own_devices(base_overrides, tmp_path, capsys) -> None:
    from mrl.cli import main
    from mrl.config.plan_report import build_report
    from mrl.config.run_plan import plan_run

    rm = write_hf_config(tmp_path / "rm", _CLS)
    sep = [*base_overrides, "cluster.n_gpus_per_node=6", "reward_model.enable=true", f"reward_model.model.path={rm}",
           "reward_model.placement=separate", "reward_model.num_devices=2",
           "reward_model.megatron.tensor_model_parallel_size=2"]
    cfg = load_config(None, sep)
    errors, notes = check_config(cfg)
    assert errors == [] and any("reward_model: separate, 2 device(s) of its own" in n and "TP=2 PP=1" in n for n in notes)
    plan = build_report(cfg)
    lay = plan.roles["reward_model"]
    assert (lay.first, lay.count, lay.dp, lay.colocated) == (4, 2, 1, False)
    assert (plan.roles["actor"].count, plan.roles["actor"].dp) == (4, 4)
    # its weights at its own TP2 (not the actor's TP1), fp32 on CPU, counted on its devices, not the actor's
    from mrl.config.hf import shape_from_dict
    from mrl.config.parallel import ParallelConfig
    from mrl.config.plan_report import params_per_device

    p = params_per_device(shape_from_dict(_CLS), ParallelConfig(tensor_model_parallel_size=2), 128, value_head=True)
    assert p < params_per_device(shape_from_dict(_CLS), ParallelConfig(), 128, value_head=True)
    assert plan.memory["reward_model"].weights == p * 4 and plan.device_total()["reward_model"] == p * 4
    assert plan.device_total()["actor"] == sum(m.total for n, m in plan.memory.items() if n != "reward_model")
    rp = plan_run(cfg, "cpu")
    assert (rp.trainer_ranks, rp.reward_model_ranks) == (4, 2)
    assert main(["plan", "mrl_configs/quickstart.yaml", *sep]) == 0  # what `mrl plan` prints
    out = capsys.readouterr().out
    assert "reward_model    2 CPU ranks [node0:4-5] TP=2 PP=1 CP=1 DP=1; owns these devices" in out, out[-3000:]
    assert "total per reward_model device if nothing is offloaded" in out
    # colocated (the default) keeps the RM on the actor's devices and layout, with no devices of its own
    cfg = load_config(None, [*base_overrides, "reward_model.enable=true", f"reward_model.model.path={rm}"])
    assert plan_run(cfg, "cpu").reward_model_ranks == 0
    assert (build_report(cfg).roles["reward_model"].count, build_report(cfg).roles["reward_model"].colocated) == (4, True)


def test_rm_layout_is_checked_against_the_rms_own_config(base_overrides, tmp_path) -> None:
    """Heads by TP and layers by PP of the RM's config.json (here 2 heads, 1 KV head, 3 layers; the actor's has 4/2/4)."""
    rm = write_hf_config(tmp_path / "rm", {**_CLS, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 3})
    sep = [*base_overrides, "cluster.n_gpus_per_node=6", "reward_model.enable=true", f"reward_model.model.path={rm}",
           "reward_model.placement=separate", "reward_model.num_devices=2"]
    e = _errors([*sep, "reward_model.megatron.tensor_model_parallel_size=2"])
    assert any("reward_model.megatron.tensor_model_parallel_size=2 does not divide the model's 1 KV heads" in x
               and f"the reward model's {rm}/config.json" in x for x in e), e
    e = _errors([*sep, "reward_model.megatron.pipeline_model_parallel_size=2"])
    assert any(x.startswith("reward_model.megatron: the 3 layers") and "fix: choose PP" in x for x in e), e
    # colocated at the actor's TP2: the RM's own heads decide (the actor's 4 / 2 divide, the RM's 1 KV head not)
    e = _errors([*base_overrides, "actor.megatron.tensor_model_parallel_size=2", "reward_model.enable=true",
                 f"reward_model.model.path={rm}"])
    assert len(e) == 1 and "actor.megatron.tensor_model_parallel_size=2 does not divide the model's 1 KV heads" in e[0] \
        and "the reward model's" in e[0], e


def test_rm_megatron_null_stays_null(base_overrides, tmp_path) -> None:
    """An empty or null reward_model.megatron means the actor's layout, not a section of defaults (TP1)."""
    f = tmp_path / "c.yaml"
    f.write_text("reward_model:\n  megatron:\n")
    assert load_config(f, [], check=False).reward_model.megatron is None
    assert load_config(None, ["reward_model.megatron=null"], check=False).reward_model.megatron is None
    cfg = load_config(None, ["reward_model.megatron.pipeline_model_parallel_size=2"], check=False)
    assert cfg.reward_model.megatron.pipeline_model_parallel_size == 2
    rm = write_hf_config(tmp_path / "rm", _CLS)
    cfg = load_config(None, [*base_overrides, "actor.megatron.tensor_model_parallel_size=2", "reward_model.enable=true",
                             f"reward_model.model.path={rm}", "reward_model.placement=separate", "cluster.n_gpus_per_node=6",
                             "reward_model.num_devices=2"])
    from mrl.config.run_plan import plan_run

    assert plan_run(cfg, "cpu").layout["reward_model"].parallel.tensor_model_parallel_size == 2  # the actor's
