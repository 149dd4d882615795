"""Override parsing: dotted keys, YAML scalars and lists, nesting, malformed items."""
from __future__ import annotations

import pytest

from mrl.config import ConfigError, apply_overrides, load_config, parse_override


@pytest.mark.parametrize(
    "item, keys, value",
    [
        ("actor.optim.lr=1e-5", ["actor", "optim", "lr"], "1e-5"),  # YAML 1.1 keeps it a string; pydantic makes it float
        ("actor.optim.lr=1.0e-5", ["actor", "optim", "lr"], 1.0e-5),
        ("rollout.n=8", ["rollout", "n"], 8),
        ("actor.use_kl_loss=true", ["actor", "use_kl_loss"], True),
        ("actor.use_kl_loss=False", ["actor", "use_kl_loss"], False),
        ("data.train_files=[a.jsonl,b.parquet]", ["data", "train_files"], ["a.jsonl", "b.parquet"]),
        ("actor.optim.betas=[0.9, 0.95]", ["actor", "optim", "betas"], [0.9, 0.95]),
        ("trainer.logger=[console,mlflow]", ["trainer", "logger"], ["console", "mlflow"]),
        ("rollout.num_engines=null", ["rollout", "num_engines"], None),
        ("trainer.experiment_name=run=7", ["trainer", "experiment_name"], "run=7"),
        ("reward.function=my_rewards.py:score", ["reward", "function"], "my_rewards.py:score"),
        ("algorithm.repr_align.ref_alignment.max_weight=0.3", ["algorithm", "repr_align", "ref_alignment", "max_weight"], 0.3),
        ("trainer.experiment_name=", ["trainer", "experiment_name"], ""),
    ],
)
def test_parse_override(item: str, keys: list[str], value: object) -> None:
    assert parse_override(item) == (keys, value)


@pytest.mark.parametrize("item", ["actor.optim.lr", "=3", "actor..lr=1", "actor.optim.lr."])
def test_malformed_override(item: str) -> None:
    with pytest.raises(ValueError, match="section.key=value"):
        parse_override(item)


def test_overrides_reach_typed_fields() -> None:
    cfg = load_config(
        None,
        ["actor.optim.lr=1e-5", "actor.optim.betas=[0.9,0.95]", "rollout.n=8", "actor.use_kl_loss=yes",
         "data.train_files=one.jsonl", "trainer.experiment_name=123", "algorithm.kl_ctrl.type=adaptive",
         "rollout.weight_sync.bucket_mb=64"],
        check=False,
    )
    assert cfg.actor.optim.lr == pytest.approx(1e-5, rel=0, abs=0)
    assert cfg.actor.optim.betas == (0.9, 0.95)
    assert cfg.rollout.n == 8 and cfg.actor.use_kl_loss is True
    assert cfg.data.train_files == ["one.jsonl"]
    assert cfg.trainer.experiment_name == "123"
    assert cfg.algorithm.kl_ctrl.type == "adaptive"
    assert cfg.rollout.weight_sync.bucket_mb == 64


def test_later_override_wins_and_yaml_is_overridden(tmp_path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  n: 2\n  temperature: 0.7\n")
    cfg = load_config(f, ["rollout.n=4", "rollout.n=6"], check=False)
    assert (cfg.rollout.n, cfg.rollout.temperature) == (6, 0.7)


def test_override_into_a_value_is_an_error() -> None:
    data: dict = {"rollout": {"n": 2}}
    errors = apply_overrides(data, ["rollout.n.x=1"])
    assert len(errors) == 1 and "'rollout.n' is a value" in errors[0]


def test_all_errors_are_collected() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["bogus", "actor.optim.lrr=1", "rollout.n=abc", "trainer.logger=[console,wandb]"], check=False)
    errs = ei.value.errors
    assert len(errs) == 4, errs
    assert "bogus" in errs[0]
    assert any("actor.optim.lrr" in e and "actor.optim.lr'" in e for e in errs)
    assert any(e.startswith("rollout.n:") for e in errs)
    assert any(e.startswith("trainer.logger[1]:") for e in errs)


def test_yaml_file_errors_name_the_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="bad.yaml: the top level must be a mapping"):
        load_config(bad)


def test_driver_filled_fields_are_validated_on_assignment() -> None:
    from pydantic import ValidationError

    cfg = load_config(None, check=False)
    cfg.actor.optim.total_training_steps = 100
    assert cfg.actor.optim.total_training_steps == 100
    with pytest.raises(ValidationError, match="total_training_steps"):
        cfg.actor.optim.total_training_steps = 0
