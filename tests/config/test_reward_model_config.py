"""reward_model: a causal LM is refused as reward model at plan time; a classifier passes with a note."""
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
    e = _errors([*rm, f"reward_model.model.path={same}", "reward_model.placement=separate"])
    assert any("reward_model.placement=separate is not implemented" in x for x in e), e
    notes = check_config(load_config(None, [*rm, f"reward_model.model.path={same}", "reward_model.offload=true"]))[1]
    assert any("offloaded to host memory outside phase rm_score" in n for n in notes)
