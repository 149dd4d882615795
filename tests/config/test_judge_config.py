"""reward.judge: every bad value is refused by check_config (what `mrl plan` runs before Ray) with the key
and the fix; `mrl plan` lists the judge's engines and their weights."""
from __future__ import annotations

import pytest

from mrl.config import ConfigError, check_config, load_config
from tests.config.conftest import TINY_QWEN2, write_hf_config


def _errors(overrides: list[str]) -> list[str]:
    try:
        return check_config(load_config(None, overrides))[0]
    except ConfigError as e:
        return e.errors


@pytest.fixture()
def judged(base_overrides, tiny_model) -> list[str]:
    return [*base_overrides, "reward.judge.enable=true", f"reward.judge.model={tiny_model}"]


def test_a_valid_judge_passes_with_a_note(judged) -> None:
    errors, notes = check_config(load_config(None, judged))
    assert errors == [] and any("reward.judge.combine=judge" in n for n in notes)


@pytest.mark.parametrize(("override", "expected"), [
    ("reward.judge.prompt_template='{prompt} {answer} {response}'", "unknown placeholder(s) {answer}"),
    ("reward.judge.prompt_template='{prompt}'", "has no {response}"),
    ("reward.judge.prompt_template='{response'", "reward.judge.prompt_template is malformed"),
    ("reward.judge.parse.pattern='yes|no'", "reward.judge.parse.pattern='yes|no' has no group"),
    ("reward.judge.parse.pattern='(yes'", "is not a valid regex"),
    ("reward.judge.parse.scores={}", "reward.judge.parse.scores is empty"),
    ("reward.judge.combine=function", "reward.judge.combine=function but reward.function='gsm8k' is a built-in"),
    ("reward.judge.token_env=X", "reward.judge.token_env is set with reward.judge.model"),
    ("reward.judge.url=http://127.0.0.1:9", "exactly one of reward.judge.model"),
    ("reward.judge.port_base=30000", "are the rollout engines'"),
    ("algorithm.adv_estimator=remax", "with algorithm.adv_estimator=remax"),
])
def test_bad_values_are_refused_naming_the_key(judged, override, expected) -> None:
    e = _errors([*judged, override])
    assert any(expected in x and "fix:" in x for x in e), e


def test_parse_json_needs_a_key_path(judged) -> None:
    e = _errors([*judged, "reward.judge.parse.type=json", "reward.judge.parse.key=a..b"])
    assert any("reward.judge.parse.key='a..b' is not a dotted key path" in x for x in e), e
    assert _errors([*judged, "reward.judge.parse.type=json", "reward.judge.parse.key=result.score"]) == []


def test_a_classifier_is_not_a_judge(base_overrides, tmp_path) -> None:
    rm = write_hf_config(tmp_path / "rm", {**TINY_QWEN2, "architectures": ["Qwen2ForSequenceClassification"]})
    e = _errors([*base_overrides, "reward.judge.enable=true", f"reward.judge.model={rm}"])
    assert any("not a *ForCausalLM" in x for x in e), e


def test_external_url_rules(base_overrides) -> None:
    url = [*base_overrides, "reward.judge.enable=true"]
    assert _errors([*url, "reward.judge.url=http://127.0.0.1:8000", "reward.judge.token_env=JUDGE_TOKEN"]) == []
    e = _errors([*url, "reward.judge.url=http://127.0.0.1:8000", "reward.judge.token_env=sk-abc123"])
    assert any("reward.judge.token_env='sk-abc123' is not an environment variable name" in x for x in e), e
    e = _errors([*url, "reward.judge.url=http://127.0.0.1:8000/v1"])
    assert any("ends with /v1" in x and "reward.judge.url=http://127.0.0.1:8000" in x for x in e), e
    e = _errors([*url, "reward.judge.url=ftp://x"])
    assert any("is not an http(s) URL" in x for x in e), e
    e = _errors([*url, "reward.judge.url=http://127.0.0.1:8000", "reward.judge.engines=2"])
    assert any("reward.judge.engines=2 with reward.judge.url" in x for x in e), e


def test_plan_lists_the_judge_engines_and_their_memory(judged) -> None:
    from mrl.config.plan_report import plan_text

    text = plan_text(load_config(None, [*judged, "reward.judge.engines=2"]))
    line = next(x for x in text.splitlines() if x.strip().startswith("judge "))
    assert "2 x torch judge engine(s)" in line and "ports 30100..30101" in line, line
    # the tiny qwen2 (0.17M params, fp32): as the rollout engine's weights
    assert "judge weights 0.6 MiB per engine" in text, text


def test_plan_names_an_external_judge(base_overrides) -> None:
    from mrl.config.plan_report import plan_text

    text = plan_text(load_config(None, [*base_overrides, "reward.judge.enable=true",
                                        "reward.judge.url=https://judge.example:8443", "reward.judge.token_env=JUDGE_TOKEN"]))
    assert "judge        external OpenAI-compatible server https://judge.example:8443 (api=completions" in text, text
