"""The judge phase against a real `mrl engine` behind an API key (SGLang's --api-key, the external-URL
mode): the right token gets verdicts, unparsable ones are counted and follow reward.on_error, a wrong
or missing token stops with the keys to fix; a refused request (4xx) is counted per sample, not retried."""
from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
import torch

from mrl.config.judge import JudgeConfig
from mrl.driver.judge import Judge, apply_fault_policy, external_token
from mrl.errors import UnsupportedConfigError
from mrl.rewards import RewardManager
from mrl.rewards.judge import JudgeHTTPError, JudgeResult, JudgeScorer

KEY = "judge-key-for-tests"


def _result(errors: list[str | None]) -> JudgeResult:
    return JudgeResult(torch.tensor([0.0 if e else 1.0 for e in errors]), errors, [None] * len(errors))


def test_fault_policy_raise_zero_mask() -> None:
    res = _result([None, "UnparsableVerdict: no match", "TimeoutError: slow"])
    with pytest.raises(RuntimeError, match=r"the judge failed on 2 of 3 samples \(1 unparsable verdicts, 1 without"):
        apply_fault_policy(res, "raise")
    assert apply_fault_policy(res, "zero").tolist() == [True, True, True]
    assert apply_fault_policy(res, "mask").tolist() == [True, False, False]
    assert apply_fault_policy(_result([None, None]), "raise").tolist() == [True, True]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from transformers import AutoTokenizer

    from mrl.quickstarts.base import write_assets
    from mrl.rollout.sglang_launcher import EngineProcess, build_embedded_command
    from tests.helpers.dist import free_port

    tmp = tmp_path_factory.mktemp("judge")
    write_assets(tmp / "assets", n_val=4, warm_start_steps=0)  # a random model: its verdicts mostly do not parse
    model = str(tmp / "assets" / "tiny-qwen2")
    port = free_port()
    eng = EngineProcess(build_embedded_command(model, port) + ["--api-key-env", "JUDGE_KEY"], f"http://127.0.0.1:{port}",
                        tmp / "engine.log", env={"OMP_NUM_THREADS": "1", "JUDGE_KEY": KEY}, startup_timeout_s=180)
    eng.start(wait=True)
    try:
        yield eng.url, AutoTokenizer.from_pretrained(model)
    finally:
        eng.stop()


def _cfg(url: str, on_error: str = "mask", **judge) -> SimpleNamespace:
    j = JudgeConfig(enable=True, url=url, token_env="JUDGE_KEY", max_new_tokens=4, **judge)
    return SimpleNamespace(reward=SimpleNamespace(judge=j, on_error=on_error))


def _rule(texts: list[str], prompts: list[SimpleNamespace]):
    """reward.function as the trainer calls it (its rule closure)."""
    rm = RewardManager("arith")
    return lambda extra: rm(texts, [p.ground_truth for p in prompts], extra_infos=extra)


def _prompts(tok, n: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(prompt_ids=tok.encode(f"question: what is {i} + 1 ? answer:"), ground_truth=str(i + 1))
            for i in range(n)]


def test_the_api_key_guards_everything_but_health(engine) -> None:
    url, _ = engine
    assert httpx.get(url + "/health", trust_env=False).status_code == 200
    assert httpx.post(url + "/v1/completions", json={"prompt": "x"}, trust_env=False).status_code == 401
    assert httpx.post(url + "/generate", json={"text": "x"}, trust_env=False).status_code == 401


def test_right_token_judges_and_counts_unparsable_verdicts(engine, monkeypatch) -> None:
    url, tok = engine
    monkeypatch.setenv("JUDGE_KEY", KEY)
    cfg = _cfg(url, parse={"pattern": r"(?s)^(.*)$", "scores": None}, batch_size=3)  # a number, or unparsable
    judge = Judge(cfg, JudgeScorer.from_config(cfg.reward.judge, [url], external_token(cfg)), tok)
    m: dict[str, float] = {}
    try:
        texts, prompts = [" 1", " 2", " 3", " 4", " 5"], _prompts(tok, 5)
        out = judge(prompts, texts, _rule(texts, prompts), [None] * 5, m)
        verdicts = judge.scorer.client.generate(["x"])
    finally:
        judge.close()
    assert isinstance(verdicts[0], str)  # an answer came: the key was accepted
    def number(v: str) -> bool:
        try:
            float(v)
            return True
        except ValueError:
            return False
    unparsed = [e is not None for e in out.errors]
    assert m["reward/judge_errors"] == 0 and m["reward/judge_unparsed"] == sum(unparsed)
    assert all(e.startswith("UnparsableVerdict") for e in out.errors if e)
    assert out.valid.tolist() == [not u for u in unparsed]  # reward.on_error=mask: out of the loss
    assert out.extra["acc"] == out.extra["rule_score"] == [1.0, 1.0, 1.0, 1.0, 1.0]  # the rule, only reported
    passed = [float(s >= 0.5) for s in out.scores.tolist()]  # the rule passes all five: agreement = judge's passes
    assert out.extra["judge_rule_agreement"] == passed
    assert len(out.extra["judge_score"]) == 5 and all(number(str(s)) for s in out.extra["judge_score"])


@pytest.mark.parametrize("token", ["wrong", None])
def test_wrong_or_missing_token_names_url_and_token_env(engine, monkeypatch, token) -> None:
    url, _ = engine
    cfg = _cfg(url)
    if token is None:
        monkeypatch.delenv("JUDGE_KEY", raising=False)
        with pytest.raises(UnsupportedConfigError, match="reward.judge.token_env=JUDGE_KEY: that environment variable"):
            external_token(cfg)
    scorer = JudgeScorer.from_config(cfg.reward.judge, [url], token, token_source="the environment variable JUDGE_KEY")
    try:
        with pytest.raises(JudgeHTTPError, match=r"HTTP 401.*JUDGE_KEY.*reward.judge.url=.*reward.judge.token_env"):
            scorer(["p"], ["r"], ["g"])
    finally:
        scorer.close()


def test_a_refused_request_is_counted_per_sample_not_retried(engine) -> None:
    url, tok = engine
    cfg = _cfg(url, on_error="zero", api="chat")  # the tiny tokenizer has no chat template: HTTP 400
    judge = Judge(cfg, JudgeScorer.from_config(cfg.reward.judge, [url], KEY), tok)
    m: dict[str, float] = {}
    try:
        texts, prompts = [" 1", " 5"], _prompts(tok, 2)
        out = judge(prompts, texts, _rule(texts, prompts), [None] * 2, m)
    finally:
        judge.close()
    assert m["reward/judge_errors"] == 2 and out.valid.tolist() == [True, True]  # zero: kept with score 0
    assert out.scores.tolist() == [0.0, 0.0] and "HTTP 400" in out.errors[0] and "chat_template" in out.errors[0]
    assert out.fault_metrics()["reward/zeroed_samples"] == 2


def test_combine_function_passes_the_judge_score_in_extra_info(engine) -> None:
    url, tok = engine
    # an empty verdict group always matches: every answer parses to the mapped 0.75
    cfg = _cfg(url, combine="function", parse={"pattern": r"^()", "scores": {"": 0.75}})
    judge = Judge(cfg, JudgeScorer.from_config(cfg.reward.judge, [url], KEY), tok)
    seen: list[dict] = []

    def doubles(solution_str, ground_truth, data_source=None, extra_info=None):
        seen.append(extra_info)
        return 2.0 * extra_info["judge_score"]

    texts, prompts = [" 1", " 9"], _prompts(tok, 2)
    rm = RewardManager(doubles)
    try:
        out = judge(prompts, texts, lambda extra: rm(texts, [p.ground_truth for p in prompts], extra_infos=extra),
                    [{"index": 0}, None])
    finally:
        judge.close()
    assert out.scores.tolist() == [1.5, 1.5] and out.extra["judge_score"] == [0.75, 0.75]
    assert seen == [{"index": 0, "judge_score": 0.75}, {"judge_score": 0.75}]  # the row's own extra_info kept
