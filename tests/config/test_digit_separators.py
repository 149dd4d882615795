"""YAML 1.1 digit separators (``0.5_2`` is 0.52 to a YAML parser): no number-looking value is silently
read as another value (issue 33). A numeric key refuses it; a key that takes a number or the band text
'L_U' (the rollout-correction thresholds) refuses it too and names the quoted form; a text-only key
gets the text as written. The same on the command line and in a file."""
from __future__ import annotations

from pathlib import Path

import pytest

from mrl.config import ConfigError, load_config

RC = "algorithm.rollout_correction"
BASE = "mrl_configs/quickstart.yaml"


def _errors(overrides: list[str], path: str = BASE) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides, check=False)
    return str(e.value)


@pytest.mark.parametrize("key, extra", [("rollout_is_threshold", f"{RC}.rollout_is=token"),
                                        ("rollout_rs_threshold", f"{RC}.rollout_rs=token_k1")])
@pytest.mark.parametrize("written", ["0.5_2", "2_0.5", "1_2"])
def test_a_threshold_written_with_a_digit_separator_is_refused_on_the_command_line(key: str, extra: str,
                                                                                   written: str) -> None:
    err = _errors([extra, f"{RC}.{key}={written}"])
    assert f"{RC}.{key}={written} is ambiguous" in err
    assert f"{key}: '{written}'" in err and f"{RC}.{key}=\"'{written}'\"" in err  # the quoted forms, file and CLI


def test_a_threshold_written_with_a_digit_separator_is_refused_in_a_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(Path(BASE).read_text() + "algorithm:\n  rollout_correction:\n    rollout_is: token\n"
                 "    rollout_is_threshold: 0.5_2\n")
    assert f"{RC}.rollout_is_threshold=0.5_2 is ambiguous" in _errors([], str(f))


def test_the_quoted_band_and_plain_numbers_are_accepted(tmp_path: Path) -> None:
    cfg = load_config(BASE, [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold='0.5_2'"], check=False)
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == "0.5_2"
    f = tmp_path / "c.yaml"
    f.write_text(Path(BASE).read_text() + "algorithm:\n  rollout_correction:\n    rollout_is: token\n"
                 "    rollout_is_threshold: '0.5_2'\n")
    assert load_config(str(f), [], check=False).algorithm.rollout_correction.rollout_is_threshold == "0.5_2"
    cfg = load_config(BASE, [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=2.5"], check=False)
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == 2.5


def test_a_numeric_key_refuses_it_and_a_text_key_keeps_the_text() -> None:
    assert "actor.optim.lr='1_2'" in _errors(["actor.optim.lr=1_2"])
    cfg = load_config(BASE, ["trainer.experiment_name=2024_11"], check=False)
    assert cfg.trainer.experiment_name == "2024_11"  # not 202411
