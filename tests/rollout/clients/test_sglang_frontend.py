"""SGLang 0.5.23's own frontend (``sglang.RuntimeEndpoint``, ``sgl.function``, ``sgl.gen``,
``sgl.select``), unchanged, against ``mrl engine``: programs run, generation equals greedy
transformers decoding, ``select`` picks what transformers' prompt log-probs pick, streaming works."""
from __future__ import annotations

import pytest

from tests.helpers.sglang_real import require
from tests.rollout.clients.oracle import TOL, Oracle
from tests.rollout.clients.served import serve

TEXT = "Q: 2+2? A:"


@pytest.fixture(scope="module")
def sgl():
    return require()  # SGLang's code from .venv/sglang-cpu (~8 s to import; once per module)


@pytest.fixture(scope="module")
def served(tmp_path_factory, sgl):
    with serve(tmp_path_factory.mktemp("sgl")) as (url, engine):
        backend = sgl.RuntimeEndpoint(url)
        yield backend, engine, Oracle(engine.runner.model_path)


def test_runtime_endpoint_info(served):
    backend, engine, _ = served
    assert backend.get_model_name() == engine.runner.model_path
    info = backend.get_server_info()
    assert info["version"] == "0.5.23" and info["max_running_requests"] == engine.scheduler.max_running
    backend.flush_cache()  # loopback engine without a token: control calls work, as before


def test_gen_equals_greedy_transformers(served, sgl):
    backend, engine, oracle = served
    tok = engine.runner.tokenizer

    @sgl.function
    def answer(s, question):
        s += question
        s += sgl.gen("a", max_tokens=6, temperature=0, ignore_eos=True, return_logprob=True)

    state = answer.run(question=TEXT, backend=backend)
    prompt = tok.encode(TEXT)
    out = oracle.greedy(prompt, 6)
    assert state["a"] == tok.decode(out)
    lps = [v for v, _, _ in state.get_meta_info("a")["output_token_logprobs"]]
    assert lps == pytest.approx(oracle.token_logprobs(prompt, out), abs=TOL)
    # Streaming through the frontend gives the same text.
    streamed = answer.run(question=TEXT, backend=backend, stream=True)
    assert "".join(streamed.text_iter("a")) == state["a"]


def test_gen_with_stop_regex(served, sgl):
    backend, engine, oracle = served
    tok = engine.runner.tokenizer
    full = tok.decode(oracle.greedy(tok.encode(TEXT), 8))
    stop = next(c for c in full[1:] if c.isprintable() and c.strip())  # a character generated after the first

    @sgl.function
    def f(s):
        s += TEXT + sgl.gen("a", max_tokens=8, temperature=0, ignore_eos=True, stop_regex=[__import__("re").escape(stop)])

    state = f.run(backend=backend)
    assert state.get_meta_info("a")["finish_reason"]["type"] == "stop"
    assert full.startswith(state["a"]) and len(state["a"]) <= full.index(stop, 1) + 1


def test_select_picks_the_transformers_choice(served, sgl):
    backend, engine, oracle = served
    tok = engine.runner.tokenizer
    choices = [" four", " five", " 4"]

    @sgl.function
    def pick(s):
        s += TEXT + sgl.select("c", choices=choices)

    state = pick.run(backend=backend)
    # What RuntimeEndpoint.select computes, from transformers' log-probs: the mean log-prob of each
    # continuation's tokens from two tokens before the end of the prompt (token healing).
    start = max(len(tok.encode(TEXT)) - 2, 0)
    means = []
    for c in choices:
        ids = tok.encode(TEXT + c)
        lp = oracle.logprobs(ids)
        vals = [float(lp[k - 1, ids[k]]) for k in range(start + 1, len(ids))]
        means.append(sum(vals) / len(vals))
    assert state["c"] == choices[max(range(len(choices)), key=means.__getitem__)]
    got = state.get_meta_info("c")["normalized_prompt_logprobs"]
    assert got == pytest.approx(means, abs=TOL)
