"""An engine too wide for the cluster is refused by messages that name ``rollout.engine_tp_size`` (issue 53: the
DeepSeek-V3 recipe with engine_tp_size=64 or 10**6 was refused only by the actor's expert grid, in words that did
not name the key that shrank the actor)."""
from __future__ import annotations

from pathlib import Path

import pytest

from mrl.config import load_config
from mrl.config.loader import ConfigError

RECIPE = Path(__file__).resolve().parents[2] / "mrl_configs" / "deepseek-v3_grpo_20x8_pp16_ep8.yaml"


def _errors(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        load_config(RECIPE, list(overrides))
    return ei.value.errors


def test_the_recipe_itself_plans() -> None:
    load_config(RECIPE, [])


def test_engines_that_starve_the_actor_are_named() -> None:
    # 2 engines x 64 = 128 of the 160 devices: the actor keeps 32, which its expert grid (EP8 x PP16) cannot fill
    errors = _errors("rollout.engine_tp_size=64")
    assert any("rollout.num_engines=2 x rollout.engine_tp_size=64 = 128" in e and "the actor's 32 devices" in e
               and "fix:" in e for e in errors), errors


def test_an_engine_wider_than_the_cluster_is_named() -> None:
    errors = _errors(f"rollout.engine_tp_size={10**6}")
    assert any(e.startswith(f"rollout.engine_tp_size={10**6} exceeds the cluster's 160 devices") and "fix:" in e
               for e in errors), errors
    assert any("rollout.engine_tp_size=1000000 = 2000000" in e for e in errors), errors  # the "leaves none" message
