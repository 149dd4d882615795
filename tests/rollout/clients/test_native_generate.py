"""SGLang's native ``/generate`` extensions on a real HTTP server: prompt log-probs
(``logprob_start_len``), top log-probs, ``n``, ``min_p``, ``stop_regex``, ``stream``, the
``/server_info`` / ``/model_info`` shapes of SGLang 0.5.23, abort on client disconnect, tiny
temperatures, and refusals of bad values. Log-probs are checked against transformers."""
from __future__ import annotations

import ast
import itertools
import json
import math

import httpx
import pytest

from tests.helpers.sglang_real import SGLANG_DIR
from tests.rollout.clients.oracle import TOL, Oracle
from tests.rollout.clients.served import healthy, serve, wait_until

PROMPT = [5, 17, 42, 9, 33, 120]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("native")) as (url, engine):
        yield url, engine, Oracle(engine.runner.model_path)


def post(url: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=kw.pop("timeout", 60), trust_env=False, **kw)


def test_prompt_and_top_logprobs_equal_transformers(served):
    url, _, oracle = served
    for start in (0, 3):
        out = post(url, {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": start,
                         "top_logprobs_num": 3, "return_text_in_logprobs": True,
                         "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}).json()
        meta = out["meta_info"]
        lp = oracle.logprobs(PROMPT + out["output_ids"])
        inp = meta["input_token_logprobs"]
        # SGLang's layout: positions start..L-1, the first without a log-prob.
        assert [t for _, t, _ in inp] == PROMPT[start:] and inp[0][0] is None and meta["input_top_logprobs"][0] is None
        for k in range(start + 1, len(PROMPT)):
            assert abs(inp[k - start][0] - float(lp[k - 1, PROMPT[k]])) < TOL
            top = meta["input_top_logprobs"][k - start]
            want = lp[k - 1].topk(3)
            assert [t for _, t, _ in top] == want.indices.tolist()
            assert max(abs(a[0] - b) for a, b in zip(top, want.values.tolist())) < TOL
        assert all(isinstance(s, str) for _, _, s in inp)
        # Greedy: each output token is its position's top-1, with the same log-prob.
        for k, ((v, t, _), top) in enumerate(zip(meta["output_token_logprobs"], meta["output_top_logprobs"])):
            assert top[0][1] == t and abs(top[0][0] - v) < 1e-6
            assert abs(v - float(lp[len(PROMPT) - 1 + k, t])) < TOL
        assert meta["output_token_logprobs_length"] == 4
    # logprob_start_len = -1 (default): output log-probs only; beyond the prompt: 400 naming it.
    meta = post(url, {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]
    assert meta["input_token_logprobs"] == [] and len(meta["output_token_logprobs"]) == 1


def test_n_samples_per_prompt_in_sglang_order(served):
    url, _, _ = served
    outs = post(url, {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 3, "n": 2}}).json()
    assert isinstance(outs, list) and [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 3, 2, 2]
    assert len({o["meta_info"]["id"] for o in outs}) == 4
    one = post(url, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "n": 3}}).json()
    assert isinstance(one, list) and len(one) == 3


def test_min_p_one_is_greedy_and_tiny_temperature_is_greedy(served):
    url, _, oracle = served
    base = {"input_ids": PROMPT, "return_logprob": True}
    greedy = post(url, {**base, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}).json()
    # min_p = 1 keeps only the most likely token: sampling at T=1 must reproduce greedy decoding.
    minp = post(url, {**base, "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "min_p": 1.0,
                                                  "ignore_eos": True}}).json()
    assert minp["output_ids"] == greedy["output_ids"]
    # temperature 1e-40 (issue: HTTP 500 with NaN log-probs): greedy like SGLang, finite log-probs.
    tiny = post(url, {**base, "sampling_params": {"max_new_tokens": 6, "temperature": 1e-40, "ignore_eos": True}})
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["output_ids"] == greedy["output_ids"]
    lps = [v for v, _, _ in tiny.json()["meta_info"]["output_token_logprobs"]]
    assert all(math.isfinite(v) for v in lps)
    assert max(abs(a - b) for a, b in zip(lps, oracle.token_logprobs(PROMPT, greedy["output_ids"]))) < TOL


def test_stop_regex_ends_the_sequence(served):
    url, engine, _ = served
    tok = engine.runner.tokenizer
    greedy = post(url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                 "ignore_eos": True}}).json()
    # A pattern matching the text of the third output token (escaped): the sequence stops there.
    third = tok.decode(greedy["output_ids"][:3])[len(tok.decode(greedy["output_ids"][:2])):]
    assert third, "third token decodes to no text"
    import re

    pattern = re.escape(third)
    first_hit = next(k for k in range(1, 9) if re.search(pattern, tok.decode(greedy["output_ids"][:k])))
    out = post(url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True,
                                                              "stop_regex": [pattern]}}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert out["output_ids"] == greedy["output_ids"][:first_hit]


def test_stream_is_sglang_sse_with_cumulative_output(served):
    url, _, _ = served
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    whole = post(url, body).json()
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=60, trust_env=False) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    ids = [c["output_ids"] for c in chunks]
    assert all(b[: len(a)] == a for a, b in itertools.pairwise(ids))  # cumulative
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["output_ids"] == whole["output_ids"] and last["text"] == whole["text"]
    assert last["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert last["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]
    # Batch / n > 1 streams carry the index of their sample.
    with httpx.stream("POST", f"{url}/generate", timeout=60, trust_env=False, json={
            "input_ids": [[1, 2], [3, 4]], "stream": True, "sampling_params": {"max_new_tokens": 3, "n": 2}}) as r:
        idx = {json.loads(ln[6:])["index"] for ln in r.iter_lines() if ln.startswith("data: {")}
    assert idx == {0, 1, 2, 3}


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_its_request(served, stream):
    url, engine, _ = served
    sched = engine.scheduler
    ctl = httpx.Client(base_url=url, timeout=30, trust_env=False)
    assert ctl.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    steps = sched.stats["decode_steps"]
    try:
        body = {"input_ids": PROMPT, "stream": stream, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        with pytest.raises(httpx.ReadTimeout), httpx.stream(
                "POST", f"{url}/generate", timeout=httpx.Timeout(30, read=1.0), trust_env=False, json=body) as r:
            for _ in r.iter_lines():
                pass
        # The engine notices within its poll interval and drops the request without decoding it.
        wait_until(lambda: sched.num_waiting == 0 and sched.num_running == 0, 10, "disconnected request not aborted")
    finally:
        ctl.post("/continue_generation")
    assert sched.stats["decode_steps"] == steps
    assert healthy(url)


def _sglang_keys(func: str) -> set[str]:
    """String keys of the dict literal SGLang 0.5.23's ``http_server.<func>`` returns (read from its source)."""
    tree = ast.parse((SGLANG_DIR / "sglang/srt/entrypoints/http_server.py").read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef) and n.name == func)
    keys: set[str] = set()
    for d in ast.walk(fn):
        if isinstance(d, ast.Dict):
            keys |= {k.value for k in d.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return keys


def test_model_info_and_server_info_have_sglang_keys(served):
    url, _, _ = served
    for path, alias, func in (("/model_info", "/get_model_info", "model_info"),
                              ("/server_info", "/get_server_info", "server_info")):
        body = httpx.get(url + path, timeout=30, trust_env=False).json()
        want = _sglang_keys(func)
        assert want and want <= set(body), f"{path} lacks SGLang's keys {sorted(want - set(body))}"
        assert set(httpx.get(url + alias, timeout=30, trust_env=False).json()) == set(body)
    info = httpx.get(url + "/server_info", timeout=30, trust_env=False).json()
    assert info["version"] == "0.5.23" and info["internal_states"][0]["num_running"] == 0


BAD = [
    ({"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
    ({"input_ids": PROMPT, "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"input_ids": PROMPT, "sampling_params": {"n": 0}}, "n"),
    ({"input_ids": PROMPT, "sampling_params": {"min_p": 1.5}}, "min_p"),
    ({"input_ids": PROMPT, "sampling_params": {"stop_regex": "(unclosed"}}, "stop_regex"),
    ({"input_ids": PROMPT, "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": PROMPT, "stream": "yes please"}, "stream"),
    ({"input_ids": PROMPT, "sampling_params": {"stop_regex": ["a"] * 33}}, "stop_regex"),
    ({"input_ids": PROMPT, "image_data": "http://x/y.png"}, "image_data"),
    ({"input_ids": [1, 99999], "return_logprob": True, "logprob_start_len": 0}, "input_ids"),
    ({"input_ids": PROMPT, "sampling_params": {"regex": "[0-9]+"}}, "regex"),
]


@pytest.mark.parametrize("body,field", BAD, ids=[f for _, f in BAD])
def test_bad_values_are_4xx_naming_the_field(served, body, field):
    url, _, _ = served
    r = post(url, body)
    assert 400 <= r.status_code < 500 and field in r.text, (r.status_code, r.text)
    assert healthy(url)


def test_auth_levels_follow_sglang(tmp_path):
    """With a token, the client routes stay open (SGLang's NORMAL level, like /generate) and the
    control routes still need it."""
    with serve(tmp_path, token="s3cret") as (url, _):
        c = httpx.Client(base_url=url, timeout=30, trust_env=False)
        for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/v1/models"):
            assert c.get(path).status_code == 200, path
        assert c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}).status_code == 200
        assert c.post("/flush_cache").status_code == 401
        assert c.post("/flush_cache", headers={"Authorization": "Bearer s3cret"}).status_code == 200
