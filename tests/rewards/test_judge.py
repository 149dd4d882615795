"""The judge's pure parts: verdict parsing (regex / json, verdict map or number, unparsable answers
raise), template rendering, and the client's bounded time against a server that never answers."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from mrl.config.judge import JudgeConfig
from mrl.rewards.judge import (
    JudgeClient,
    JudgeScorer,
    UnparsableVerdict,
    parse_verdict,
    render,
)


@pytest.mark.parametrize(("text", "score"), [(" yes</s>", 1.0), ("No.", 0.0), ("I think YES", 1.0)])
def test_regex_verdict_mapped(text, score) -> None:
    assert parse_verdict(text, scores={"yes": 1.0, "no": 0.0}) == score


def test_named_group_and_number_verdicts() -> None:
    assert parse_verdict("score: 7/10", pattern=r"(?P<x>\w+): (?P<verdict>\d+)/10", scores=None) == 7.0
    assert parse_verdict("rating 0.25", pattern=r"rating (\S+)", scores=None) == 0.25


def test_json_verdict_at_a_key_path() -> None:
    text = 'Here: {"result": {"score": 0.5, "why": "close"}} done'
    assert parse_verdict(text, type="json", key="result.score", scores=None) == 0.5
    assert parse_verdict('{"verdict": "Yes"}', type="json", key="verdict", scores={"yes": 1, "no": 0}) == 1.0


@pytest.mark.parametrize(("text", "kw", "why"), [
    ("maybe", {}, "no match of reward.judge.parse.pattern"),
    ("rating high", {"pattern": r"rating (\S+)", "scores": None}, "is not a number"),
    ("rating nan", {"pattern": r"rating (\S+)", "scores": None}, "is not finite"),
    ("yes", {"scores": {"no": 0.0}}, "is not in reward.judge.parse.scores"),
    ("no json here", {"type": "json"}, "no JSON object"),
    ('{"a": 1}', {"type": "json", "key": "b"}, "has no key 'b'"),
    ('{"score": true}', {"type": "json", "scores": None}, "is a boolean"),
])
def test_unparsable_answers_raise_naming_why(text, kw, why) -> None:
    with pytest.raises(UnparsableVerdict, match=why):
        parse_verdict(text, **{"scores": {"yes": 1.0, "no": 0.0}, **kw})


def test_render_fills_the_three_placeholders_and_keeps_braces_in_samples() -> None:
    t = "Q: {prompt}\nA: {response}\nRef: {ground_truth} {{json}}"
    assert render(t, "1+1?", "{2}", 2) == "Q: 1+1?\nA: {2}\nRef: 2 {json}"
    assert render(t, "p", "r", None).endswith("Ref:  {json}")


class _Silent:
    """A TCP server that accepts and reads but never answers (a hung judge)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.sock.close()


def test_a_judge_that_never_answers_costs_bounded_time_and_counts_every_sample() -> None:
    server = _Silent()
    cfg = JudgeConfig(enable=True, url=server.url, timeout_s=0.3, max_retries=1, batch_size=2, max_concurrency=2)
    scorer = JudgeScorer.from_config(cfg, [server.url], None)
    try:
        t0 = time.monotonic()
        res = scorer(["p"] * 4, ["r"] * 4, ["g"] * 4)
        took = time.monotonic() - t0
    finally:
        scorer.close()
        server.close()
    # 2 requests in parallel, each 2 tries of 0.3 s + 0.2 s backoff: ~0.8 s; 20 s = wide margin for a loaded host
    assert took < 20, took
    assert res.failed == 4 and res.unparsed == 0 and all(e.startswith("TimeoutError") for e in res.errors)
    assert "reward.judge.timeout_s=0.3" in res.errors[0]
    assert res.scores.tolist() == [0.0] * 4
    m = res.metrics()
    assert m["reward/judge_errors"] == 4 and m["reward/judge_unparsed"] == 0


def test_the_client_refuses_an_empty_server_list() -> None:
    with pytest.raises(ValueError, match="at least one server url"):
        JudgeClient([])
