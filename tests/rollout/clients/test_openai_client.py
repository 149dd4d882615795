"""The real ``openai`` package, unchanged, against ``mrl engine``: models, completions, chat
completions (the tokenizer's chat template), ``n``, ``logprobs``/``top_logprobs`` (equal to
transformers'), ``stop``, ``seed``, streaming with usage, and bad input (400 naming the field,
server still healthy)."""
from __future__ import annotations

import openai
import pytest

from tests.rollout.clients.oracle import TOL, Oracle
from tests.rollout.clients.served import healthy, serve

PROMPT = "1+2=3, 4+5="


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("openai")) as (url, engine):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        yield url, engine, client, Oracle(engine.runner.model_path)


def test_models(served):
    _, engine, client, _ = served
    assert [m.id for m in client.models.list().data] == [engine.runner.model_path]


def test_completion_logprobs_equal_transformers(served):
    _, engine, client, oracle = served
    tok = engine.runner.tokenizer
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, n=2,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 2 and r.choices[0].text == r.choices[1].text  # greedy
    prompt_ids = tok.encode(PROMPT)
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == 12
    c = r.choices[0]
    assert c.finish_reason == "length" and "".join(c.logprobs.tokens) == c.text
    out_ids = oracle.greedy(prompt_ids, 6)
    assert c.text == tok.decode(out_ids)
    want = oracle.token_logprobs(prompt_ids, out_ids)
    assert max(abs(a - b) for a, b in zip(c.logprobs.token_logprobs, want)) < TOL
    top = oracle.logprobs(prompt_ids + out_ids)[len(prompt_ids) - 1:].topk(2)
    for k, alts in enumerate(c.logprobs.top_logprobs):
        # {token text: log-prob} (OpenAI's legacy shape: tokens with the same text share a key).
        assert max(alts.values()) == pytest.approx(float(top.values[k, 0]), abs=TOL)
        assert all(min(abs(v - w) for w in top.values[k].tolist()) < TOL for v in alts.values())
    assert all(len(t) <= 2 for t in c.logprobs.top_logprobs)
    # A list of token-id prompts answers one choice per prompt (x n).
    r = client.completions.create(model="m", prompt=[[5, 6, 7], [8, 9]], max_tokens=2, n=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]


def test_stop_and_seed(served):
    _, _, client, _ = served
    full = client.completions.create(model="m", prompt=PROMPT, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[3:5]
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=10, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True}).choices[0]
    assert r.finish_reason == "stop" and r.text == full[: full.find(stop)]
    a, b = (client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


def test_chat_uses_the_chat_template(served):
    _, engine, client, oracle = served
    tok = engine.runner.tokenizer
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.role == "assistant"
    content = r.choices[0].logprobs.content
    out_ids = oracle.greedy(ids, 5)
    assert r.choices[0].message.content == tok.decode(out_ids)
    assert [e.logprob for e in content] == pytest.approx(oracle.token_logprobs(ids, out_ids), abs=TOL)
    for e in content:  # greedy: each token is its position's most likely one
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6) and len(e.top_logprobs) == 2


def test_streaming_equals_non_streaming(served):
    _, _, client, _ = served
    kw = {"model": "m", "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(prompt=PROMPT, **kw).choices[0].text
    parts, usage = [], None
    for ch in client.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **kw):
        parts += [c.text for c in ch.choices]
        usage = ch.usage or usage
    assert "".join(parts) == whole and usage.completion_tokens == 8
    msgs = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(messages=msgs, **kw).choices[0].message.content
    deltas, reasons = [], []
    for ch in client.chat.completions.create(messages=msgs, stream=True, **kw):
        deltas += [c.delta.content or "" for c in ch.choices]
        reasons += [c.finish_reason for c in ch.choices if c.finish_reason]
    assert "".join(deltas) == whole and reasons == ["length"]


BAD = [
    ("completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
    ("completions", {"prompt": PROMPT, "n": 0}, "n"),
    ("completions", {"prompt": PROMPT, "logprobs": 99}, "logprobs"),
    ("completions", {"prompt": "", "max_tokens": 2}, "prompt"),
    ("completions", {"prompt": PROMPT, "extra_body": {"echo": True}}, "echo"),
    ("completions", {"prompt": PROMPT, "extra_body": {"frequency_penalty": 0.5}}, "frequency_penalty"),
    ("completions", {"prompt": [[1, 99999]], "max_tokens": 2}, "input_ids"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "extra_body": {"tools": []}}, "tools"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "extra_body": {"stop_regex": "("}}, "stop_regex"),
]


@pytest.mark.parametrize("route,kw,field", BAD, ids=[f"{r}-{f}" for r, _, f in BAD])
def test_bad_input_is_400_naming_the_field(served, route, kw, field):
    url, _, client, _ = served
    create = client.completions.create if route == "completions" else client.chat.completions.create
    with pytest.raises(openai.BadRequestError) as e:
        create(model="m", **kw)
    assert field in str(e.value)
    assert healthy(url)
