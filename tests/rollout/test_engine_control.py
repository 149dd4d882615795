"""Embedded engine control plane, SGLang's rules: pause modes (retract loses and repeats no token),
/flush_cache refused while busy, the begin/end weight-update window, memory-release tags.

The scheduler is driven step by step where timing would otherwise decide the outcome (a request
is paused after exactly k decode steps), so nothing here depends on load."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from mrl.rollout.engine.scheduler import Request
from mrl.rollout.engine.server import Engine, build_app
from mrl.rollout.protocol import SamplingParams
from tests.helpers.tiny_models import make_tiny_hf

PROMPT = [5, 17, 33, 101, 7]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf(tmp_path_factory.mktemp("ctl") / "llama", "llama")


def _request(seed: int) -> Request:
    return Request(prompt_ids=list(PROMPT), return_logprob=True,
                   params=SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, sampling_seed=seed))


def _steps(engine: Engine, req: Request, decode_steps: int) -> None:
    """Admit ``req`` and run ``decode_steps`` decode steps by hand (the loop thread is not running)."""
    s = engine.scheduler
    s.submit(req)
    with s.model_lock:
        s._prefill([s._waiting.popleft()])
        for _ in range(decode_steps):
            s._decode()


@pytest.mark.parametrize("seed", [3, 11])
def test_retract_resumes_without_losing_or_repeating_a_token(model_dir, seed):
    ref_engine = Engine(str(model_dir))
    with TestClient(build_app(ref_engine)) as c:
        ref = c.post("/generate", json={"input_ids": PROMPT, "return_logprob": True, "sampling_params": {
            "temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True, "sampling_seed": seed}}).json()

    engine = Engine(str(model_dir))
    req = _request(seed)
    _steps(engine, req, decode_steps=6)
    assert len(req.output_ids) == 7 and engine.scheduler.num_running == 1
    client = TestClient(build_app(engine))  # no lifespan yet: the loop is still stopped
    assert client.post("/pause_generation", json={"mode": "retract"}).json()["num_paused_requests"] == 1
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 1
    assert client.post("/flush_cache").status_code == 200  # waiting requests do not block a paused flush
    with client:  # starts the loop
        assert client.post("/continue_generation", json={}).json()["status"] == "ok"
        done = req.future.result(timeout=60)
    assert done.output_ids == ref["output_ids"]  # same draws, each token exactly once
    got = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(done.logprobs, got)) < 1e-5  # rebuilt KV, same log-probs
    assert engine.scheduler.stats["retracted"] == 1


def test_flush_refused_while_requests_run_in_place(model_dir):
    engine = Engine(str(model_dir))
    req = _request(0)
    _steps(engine, req, decode_steps=2)
    client = TestClient(build_app(engine))
    assert client.post("/flush_cache").status_code == 400  # running, not paused
    client.post("/pause_generation", json={"mode": "in_place"})
    r = client.post("/flush_cache")
    assert r.status_code == 400 and "#running-req: 1" in r.text  # in_place keeps the request running
    assert client.post("/release_memory_occupation", json={}).status_code == 400  # SGLang: only when idle
    client.post("/pause_generation", json={"mode": "abort"})  # SGLang's default mode
    assert req.future.result(timeout=10).finish_reason["type"] == "abort"
    assert client.post("/flush_cache").status_code == 200


def test_weight_update_window(model_dir):
    with TestClient(build_app(Engine(str(model_dir)))) as c:
        body = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[300, 64]], "group_name": "g"}
        r = c.post("/update_weights_from_distributed", json=body)
        assert r.status_code == 400 and "begin_weight_update" in r.json()["message"]
        assert c.post("/end_weight_update", json={}).status_code == 400
        assert c.post("/begin_weight_update", json={}).status_code == 200
        assert c.post("/begin_weight_update", json={}).status_code == 400  # already open
        r = c.post("/update_weights_from_distributed", json=body)
        assert r.status_code == 400 and "no weight update group 'g'" in r.json()["message"]  # now past the window
        assert c.post("/end_weight_update", json={}).status_code == 200
        assert c.post("/begin_weight_update", json={"selector": "everything"}).status_code == 422


def test_memory_release_honours_tags(model_dir):
    gen = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    with TestClient(build_app(Engine(str(model_dir)))) as c:
        before = c.post("/generate", json=gen).json()["output_ids"]
        assert c.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
        assert c.post("/generate", json=gen).json()["output_ids"] == before  # weights stayed
        assert c.post("/release_memory_occupation", json={"tags": ["weights"]}).status_code == 200
        assert c.post("/generate", json=gen).status_code == 503
        assert c.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
        assert c.post("/generate", json=gen).status_code == 503  # weights still released
        assert c.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
        assert c.post("/generate", json=gen).json()["output_ids"] == before
        r = c.post("/release_memory_occupation", json={"tags": ["kv"]})
        assert r.status_code == 422 and "kv_cache" in r.text
