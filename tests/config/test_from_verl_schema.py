"""`mrl from-verl`'s key tables against verl's own config schema (issue 45 item 1).

verl 0.9.1 (the pinned oracle, requirements-oracles.txt, installed into ``.venv/oracles`` by ``make install``) ships
its full trainer config as ``verl/trainer/config/_generated_ppo_{megatron_,}trainer.yaml``. Every key mrl translates
(KEYS, CONVERTERS) or explains (UNMAPPED) must be a key of that schema, or listed in OUTSIDE_VERL_0_9_1 with where
launch scripts still carry it; and every key listed there must really be absent from the schema, so the list cannot
go stale. A prefix entry (ending in '.') matches when some schema key lies under it.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mrl.config import from_verl as fv
from tests.helpers.verl_oracle import ORACLE_DIR

SCHEMA_FILES = ("_generated_ppo_megatron_trainer.yaml", "_generated_ppo_trainer.yaml")


def _flatten(node, prefix: str, out: set[str]) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            out.add(prefix + str(k))
            _flatten(v, f"{prefix}{k}.", out)


@pytest.fixture(scope="module")
def schema() -> set[str]:
    root = ORACLE_DIR / "verl" / "trainer" / "config"
    files = [root / f for f in SCHEMA_FILES]
    missing = [str(f) for f in files if not f.is_file()]
    assert not missing, f"verl's config schema is not installed ({missing}): run `make install`"  # fail, never skip
    keys: set[str] = set()
    for f in files:
        _flatten(yaml.safe_load(Path(f).read_text(encoding="utf-8")), "", keys)
    return keys


def in_schema(key: str, keys: set[str]) -> bool:
    if key.endswith("."):
        return key[:-1] in keys or any(k.startswith(key) for k in keys)
    return key in keys


def test_the_schema_is_verls_own(schema: set[str]) -> None:
    assert len(schema) > 1000
    assert {"actor_rollout_ref.actor.ppo_mini_batch_size", "algorithm.rollout_correction.rollout_is",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size"} <= schema


def test_every_translated_or_explained_key_is_verls_or_sourced(schema: set[str]) -> None:
    tables = {"KEYS": fv.KEYS, "CONVERTERS": fv.CONVERTERS, "UNMAPPED": fv.UNMAPPED}
    unsourced = [f"{name}: {k}" for name, table in tables.items() for k in table
                 if not in_schema(k, schema) and k not in fv.OUTSIDE_VERL_0_9_1]
    assert not unsourced, ("keys verl 0.9.1's schema does not have: remove them or list them in OUTSIDE_VERL_0_9_1 "
                           "with their source:\n" + "\n".join(unsourced))


def test_the_sourced_keys_are_really_outside_the_schema_and_used(schema: set[str]) -> None:
    stale = [k for k in fv.OUTSIDE_VERL_0_9_1 if in_schema(k, schema)]
    assert not stale, f"now in verl's schema, drop from OUTSIDE_VERL_0_9_1: {stale}"
    tables = set(fv.KEYS) | set(fv.CONVERTERS) | set(fv.UNMAPPED)
    assert set(fv.OUTSIDE_VERL_0_9_1) <= tables, set(fv.OUTSIDE_VERL_0_9_1) - tables
    assert all(src.strip() for src in fv.OUTSIDE_VERL_0_9_1.values())


def test_verl_0_9_keys_translate() -> None:
    """The sections verl 0.9 writes (reward.*, algorithm.rollout_correction.*) reach mrl's keys."""
    t = fv.translate_overrides([
        "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0",
        "reward.reward_model.enable=True", "reward.reward_model.model_path=/m/rm", "reward.num_workers=8",
        "reward.custom_reward_function.path=/r/score.py", "reward.custom_reward_function.name=my_score"])
    assert t.get("algorithm.rollout_correction") == {"rollout_is": "token", "rollout_is_threshold": 2.0}
    assert t.get("reward_model.enable") is True and t.get("reward_model.model.path") == "/m/rm"
    assert t.get("reward.workers") == 8 and t.get("reward.function") == "/r/score.py:my_score"
    assert not t.unmapped
