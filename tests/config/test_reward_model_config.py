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
