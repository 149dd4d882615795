"""teacher / algorithm.distill: the rules between them, the teacher's placement and layout against its own
config.json, its vocabulary against the student's, and what `mrl plan` shows of it."""
from __future__ import annotations

import pytest

from mrl.config import ConfigError, check_config, load_config
from mrl.config.plan_report import build_report, format_report
from tests.config.conftest import TINY_QWEN2, write_hf_config


def _errors(overrides: list[str]) -> list[str]:
    try:
        return check_config(load_config(None, overrides))[0]
    except ConfigError as e:
        return e.errors


@pytest.fixture
def teacher(tmp_path):
    # wider and deeper than the student, 6 heads: TP=4 cannot split it although it splits the student
    return write_hf_config(tmp_path / "teacher", {**TINY_QWEN2, "hidden_size": 96, "num_attention_heads": 6,
                                                  "num_key_value_heads": 2, "num_hidden_layers": 6})


def test_distill_and_teacher_need_each_other(base_overrides, teacher) -> None:
    e = _errors([*base_overrides, "algorithm.distill.mode=reverse_kl_reward"])
    assert len(e) == 1 and "needs a teacher" in e[0] and "teacher.enable=true" in e[0], e
    e = _errors([*base_overrides, "teacher.enable=true", f"teacher.path={teacher}"])
    assert len(e) == 1 and "feed nothing" in e[0] and "algorithm.distill.mode=" in e[0], e
    e = _errors([*base_overrides, "algorithm.distill.mode=kl_loss", "teacher.enable=true"])
    assert any("teacher.path is not set" in x for x in e), e
    e = _errors([*base_overrides, f"teacher.path={teacher}"])
    assert any("teacher.path is set but teacher.enable=false" in x for x in e), e
    e = _errors([*base_overrides, "algorithm.distill.mode=kl_loss", "algorithm.distill.coef=0",
                 "teacher.enable=true", f"teacher.path={teacher}"])
    assert any("algorithm.distill.coef" in x for x in e), e


def test_placement_and_layout_against_the_teachers_own_config(base_overrides, teacher) -> None:
    on = [*base_overrides, "algorithm.distill.mode=kl_loss", "teacher.enable=true", f"teacher.path={teacher}"]
    assert _errors(on) == []
    e = _errors([*on, "actor.megatron.tensor_model_parallel_size=4", "actor.ppo_mini_batch_size=8"])
    assert any("actor.megatron.tensor_model_parallel_size=4 does not divide the model's 6 attention heads" in x
               and "teacher's" in x for x in e), e
    e = _errors([*on, "teacher.num_devices=2"])
    assert any("teacher.num_devices is only used with teacher.placement=separate" in x for x in e), e
    e = _errors([*on, "teacher.megatron.pipeline_model_parallel_size=2"])
    assert any("a colocated teacher runs in the actor's Megatron groups" in x for x in e), e
    e = _errors([*on, "teacher.placement=separate"])
    assert any("teacher.placement=separate needs teacher.num_devices" in x for x in e), e
    e = _errors([*on, "teacher.placement=separate", "teacher.num_devices=2", "teacher.offload=true"])
    assert any("teacher.offload=true is for a colocated teacher" in x for x in e), e
    e = _errors([*on, "teacher.placement=separate", "teacher.num_devices=2",
                 "teacher.megatron.pipeline_model_parallel_size=4"])
    assert any("teacher.megatron: TP*PP*CP" in x for x in e), e
    # reverse_kl_reward reads log pi_old before the update: the on-policy shortcut cannot apply
    e = _errors([*base_overrides, "algorithm.distill.mode=reverse_kl_reward", "teacher.enable=true",
                 f"teacher.path={teacher}", "actor.on_policy_shortcut=true"])
    assert any("reverse_kl_reward" in x for x in e), e


def test_plan_shows_the_teacher_role_and_its_memory(base_overrides, teacher) -> None:
    sep = [*base_overrides, "cluster.n_gpus_per_node=6", "algorithm.distill.mode=reverse_kl_reward",
           "teacher.enable=true", f"teacher.path={teacher}", "teacher.placement=separate", "teacher.num_devices=2",
           "teacher.megatron.tensor_model_parallel_size=2"]
    cfg = load_config(None, sep)
    assert check_config(cfg)[0] == []
    text = format_report(cfg, plan := build_report(cfg))
    assert "teacher         2 CPU ranks [node0:4-5] TP=2 PP=1 CP=1 DP=1; owns these devices" in text, text
    assert plan.roles["actor"].count == 4 and "teacher" in plan.memory and plan.memory["teacher"].weights > 0
    colo = load_config(None, [*base_overrides, "algorithm.distill.mode=kl_loss", "teacher.enable=true",
                              f"teacher.path={teacher}"])
    text = format_report(colo, build_report(colo))
    assert "teacher         4 CPU ranks [node0:0-3] TP=1 PP=1 CP=1 DP=4; colocated with actor" in text, text


def test_vocabulary_must_be_the_students(base_overrides, tmp_path) -> None:
    from tests.helpers.tiny_tokenizer import save_other_tokenizer, save_tiny_tokenizer

    student = write_hf_config(tmp_path / "student", TINY_QWEN2)
    save_tiny_tokenizer(student)
    same = write_hf_config(tmp_path / "same", {**TINY_QWEN2, "num_hidden_layers": 2})
    save_tiny_tokenizer(same)
    other = write_hf_config(tmp_path / "other", {**TINY_QWEN2, "vocab_size": 260})
    save_other_tokenizer(other)
    on = [*[o for o in base_overrides if not o.startswith("model.path=")], f"model.path={student}",
          "algorithm.distill.mode=kl_loss", "teacher.enable=true"]
    assert _errors([*on, f"teacher.path={same}"]) == []
    e = _errors([*on, f"teacher.path={other}"])
    assert len(e) == 1 and "is not the student's" in e[0] and "same token ids" in e[0], e
    # mrl train's preflight loads both tokenizers as the run does
    from mrl.config.validate_teacher import tokenizer_mismatch

    assert tokenizer_mismatch(str(student), str(same), False) is None
    assert "is not the student's" in tokenizer_mismatch(str(student), str(other), False)
