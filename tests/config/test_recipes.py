"""Shipped recipes: each is valid, and none repeats a default (defaults live only in mrl/config)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from mrl.config import MRLConfig, load_config

RECIPES = sorted((Path(__file__).resolve().parents[2] / "mrl_configs").glob("*.yaml"))


def _leaves(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in d.items():
        out += _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]
    return out


def test_there_are_recipes() -> None:
    assert len(RECIPES) >= 3


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_recipe_is_valid_and_repeats_no_default(path: Path) -> None:
    load_config(path)  # valid: check_config passes
    defaults = MRLConfig().model_dump(mode="json")
    repeated = []
    for key, value in _leaves(yaml.safe_load(path.read_text())):
        node: Any = defaults
        for part in key.split("."):
            node = node[part]
        if node == value:
            repeated.append(key)
    assert repeated == [], f"{path.name} repeats defaults: {repeated}"
