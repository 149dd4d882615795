"""Embedded engine through its HTTP app: log-prob parity with transformers, finish semantics,
continuous batching, seeds, pause/continue, abort and the control token."""
from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from mrl.rollout.engine.server import Engine, build_app
from tests.helpers.tiny_models import make_tiny_hf

PROMPTS = [[5, 17, 33, 101, 7, 9, 250, 12, 44, 3, 99], [8, 9], [120, 121, 122, 123, 124], [42] * 20]


def _client(path, **kw) -> tuple[Engine, TestClient]:
    token = kw.pop("token", None)
    engine = Engine(str(path), **kw)
    return engine, TestClient(build_app(engine, token=token))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2")


@pytest.fixture(scope="module")
def server(model_dir):
    engine, client = _client(model_dir)
    with client:
        yield engine, client


def _gen(client, **body):
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _ref_logprobs(model_dir, prompt, output, temperature):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(1, torch.tensor(output)[:, None]).squeeze(1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_transformers(server, model_dir, temperature):
    _, client = server
    outs = _gen(client, input_ids=PROMPTS, return_logprob=True,
                sampling_params={"temperature": temperature, "max_new_tokens": 12, "ignore_eos": True})
    for prompt, out in zip(PROMPTS, outs):
        lps = out["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in lps] == out["output_ids"] and all(x is None for _, _, x in lps)
        ref = _ref_logprobs(model_dir, prompt, out["output_ids"], temperature)
        got = torch.tensor([lp for lp, _, _ in lps])
        assert torch.allclose(got, ref, atol=1e-5, rtol=0), (got - ref).abs().max()


def test_greedy_matches_transformers_generate(server, model_dir):
    _, client = server
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = _gen(client, input_ids=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": 10, "ignore_eos": True})
    for prompt, out in zip(PROMPTS, outs):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10)
        assert out["output_ids"] == ref[0, len(prompt):].tolist()


def test_repeated_prompts_are_prefilled_once_with_exact_logprobs(model_dir):
    """The n samples of a prompt arrive as one batch: each distinct prompt is computed once, and
    every copy's log-probs still equal transformers' (greedy: the copies agree token for token)."""
    engine, client = _client(model_dir)
    with client:
        batch = [PROMPTS[0]] * 4 + [PROMPTS[1]] * 3 + [PROMPTS[2]]
        for temperature in (0.0, 1.0):
            outs = _gen(client, input_ids=batch, return_logprob=True,
                        sampling_params={"temperature": temperature, "max_new_tokens": 6, "ignore_eos": True})
            for prompt, out in zip(batch, outs):
                lps = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
                ref = _ref_logprobs(model_dir, prompt, out["output_ids"], 1.0)
                assert torch.allclose(lps, ref, atol=1e-5, rtol=0), (lps - ref).abs().max()
            if temperature == 0.0:
                assert len({tuple(o["output_ids"]) for o in outs[:4]}) == 1
                assert len({tuple(o["output_ids"]) for o in outs[4:7]}) == 1
    assert engine.scheduler.stats["prefilled_requests"] == 16

    # Once per distinct prompt, whatever the admission timing: the model's forward sees 3 rows for 8,
    # and the copies' cache and logits equal an undeduplicated prefill of the same batch.
    runner, seen = engine.runner, []
    hook = runner.model.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    try:
        rows, logits = runner.prefill(batch)
        want_rows, want_logits = runner._prefill(batch)
    finally:
        hook.remove()
    assert seen == [3, 8]
    assert torch.allclose(logits, want_logits, atol=1e-6, rtol=0)
    for got, want in zip(rows.keys + rows.values, want_rows.keys + want_rows.values):
        assert torch.allclose(got, want, atol=1e-6, rtol=0)
    assert torch.equal(rows.valid, want_rows.valid) and torch.equal(rows.next_pos, want_rows.next_pos)


def test_max_new_tokens_and_length_reason(server):
    _, client = server
    out = _gen(client, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 5, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert out["meta_info"]["completion_tokens"] == 5 and len(out["output_ids"]) == 5
    assert out["meta_info"]["prompt_tokens"] == 3
    zero = _gen(client, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 0})
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_token_ids_and_stop_strings(server, model_dir):
    _, client = server
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    base = _gen(client, input_ids=PROMPTS[0], sampling_params=sp)["output_ids"]
    stop_tok = base[4]
    first = base.index(stop_tok)
    out = _gen(client, input_ids=PROMPTS[0], sampling_params={**sp, "stop_token_ids": [stop_tok]})
    assert out["output_ids"] == base[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}

    tok = AutoTokenizer.from_pretrained(model_dir)
    # A stop string made of the decoded text of tokens 3..4: generation ends once it appears.
    full = tok.decode(base)
    stop_s = tok.decode(base[3:5])
    assert stop_s and stop_s in full
    out = _gen(client, input_ids=PROMPTS[0], sampling_params={**sp, "stop": [stop_s]})
    fr = out["meta_info"]["finish_reason"]
    assert fr == {"type": "stop", "matched": stop_s}
    assert len(out["output_ids"]) <= 5 and out["output_ids"] == base[: len(out["output_ids"])]
    assert stop_s not in out["text"] and full.startswith(out["text"])
    kept = _gen(client, input_ids=PROMPTS[0], sampling_params={**sp, "stop": stop_s, "no_stop_trim": True})
    assert kept["text"].endswith(stop_s) or stop_s in kept["text"]


def test_eos_and_ignore_eos(tmp_path, model_dir, server):
    _, client = server
    base = _gen(client, input_ids=PROMPTS[1], sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
    eos = base["output_ids"][2]
    first = base["output_ids"].index(eos)
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (d / "config.json").write_text(json.dumps(cfg))
    _, c2 = _client(d)
    with c2:
        out = _gen(c2, input_ids=PROMPTS[1], sampling_params={"temperature": 0, "max_new_tokens": 8})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
        assert out["output_ids"] == base["output_ids"][: first + 1]
        out = _gen(c2, input_ids=PROMPTS[1], sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
        assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 8


def test_seeded_sampling_independent_of_batch(server):
    _, client = server
    sp = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "max_new_tokens": 10, "ignore_eos": True, "sampling_seed": 123}
    alone = _gen(client, input_ids=PROMPTS[2], sampling_params=sp)["output_ids"]
    batch = _gen(client, input_ids=[PROMPTS[0], PROMPTS[2], PROMPTS[3]],
                 sampling_params=[{**sp, "sampling_seed": 7}, sp, {**sp, "sampling_seed": 9}])
    assert batch[1]["output_ids"] == alone
    assert batch[0]["output_ids"] != alone


def test_continuous_batching_admits_into_running_set(model_dir):
    engine, client = _client(model_dir, max_running=4)
    lengths = [1, 40, 3, 25, 2, 37, 5, 11, 29, 4, 17, 8]
    with client:
        prompts = [[(7 * i + j) % 290 + 3 for j in range(3 + (i * 13) % 30)] for i in range(len(lengths))]
        outs = _gen(client, input_ids=prompts,
                    sampling_params=[{"max_new_tokens": n, "ignore_eos": True} for n in lengths])
        stats = dict(engine.scheduler.stats)
    assert [len(o["output_ids"]) for o in outs] == lengths
    assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": n} for o, n in zip(outs, lengths))
    assert stats["max_batch"] == 4
    # Requests entered the batch while others were mid-decode (not one static batch after another).
    assert stats["admitted_while_running"] >= len(lengths) // 2
    # Finished rows leave at once: decoded rows = sum(n - 1) (the first token comes from prefill).
    assert stats["decode_tokens"] == sum(n - 1 for n in lengths)


def test_admission_waits_for_min_admit_free_slots(model_dir):
    """Under steady load (more requests than slots) a freed slot is refilled only once
    ``min_admit`` slots are free, so prefills come in groups: with 8 slots, min_admit 4 and 24
    requests of distinct lengths there are at most 1 (the request is queued at once) + 16 / 4
    prefills, where one per freed slot would be ~17."""
    engine, client = _client(model_dir, max_running=8)
    engine.scheduler.min_admit = 4
    lengths = [3 + (5 * i) % 23 + i for i in range(24)]
    with client:
        prompts = [[(11 * i + j) % 290 + 3 for j in range(4 + i % 7)] for i in range(len(lengths))]
        outs = _gen(client, input_ids=prompts,
                    sampling_params=[{"max_new_tokens": n, "ignore_eos": True} for n in lengths])
        stats = dict(engine.scheduler.stats)
    assert [len(o["output_ids"]) for o in outs] == lengths
    assert stats["max_batch"] == 8
    assert stats["prefilled_requests"] == len(lengths)
    assert stats["prefill_batches"] <= 1 + (len(lengths) - 8) // 4, stats


def test_a_batch_request_is_queued_at_once_all_or_nothing(model_dir):
    """Scheduler.submit_many: a request's samples enter the queue together, so an idle engine admits them
    in one prefill (queued one by one, the loop started on the first few); one bad sample queues none."""
    engine, client = _client(model_dir)
    with client:
        for _ in range(3):
            prompts = [[(5 * i + j) % 290 + 3 for j in range(2 + i % 9)] for i in range(48)]
            _gen(client, input_ids=prompts, sampling_params={"max_new_tokens": 2, "ignore_eos": True})
        stats = dict(engine.scheduler.stats)
        assert stats["prefill_batches"] == 3 and stats["prefilled_requests"] == 3 * 48, stats
        r = client.post("/generate", json={"input_ids": [[3, 4]] * 40 + [[3, 100000]]})
        assert r.status_code == 400 and "vocabulary" in r.text
        assert engine.scheduler.stats["submitted"] == stats["submitted"] and engine.scheduler.num_waiting == 0


def test_many_concurrent_http_requests(server):
    engine, client = server
    results: dict[int, dict] = {}

    def worker(i: int) -> None:
        results[i] = _gen(client, input_ids=[3 + i] * (1 + 9 * (i % 4)),
                          sampling_params={"max_new_tokens": 2 + 5 * (i % 6), "ignore_eos": True})

    before = engine.scheduler.stats["max_batch"]
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == list(range(16))
    assert all(len(results[i]["output_ids"]) == 2 + 5 * (i % 6) for i in range(16))
    assert max(before, engine.scheduler.stats["max_batch"]) > 1


def test_pause_continue_and_abort(server):
    engine, client = server
    assert client.post("/pause_generation", json={}).json()["status"] == "ok"
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(out=_gen(
        client, input_ids=[4, 5, 6], rid="paused-req", sampling_params={"max_new_tokens": 3, "ignore_eos": True})))
    t.start()
    deadline = time.time() + 60
    while engine.scheduler.num_waiting == 0 and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # a paused engine that served anyway would finish 3 tokens well within this
    assert t.is_alive() and engine.scheduler.num_waiting == 1  # queued, not served while paused
    client.post("/continue_generation")
    t.join(timeout=60)
    assert box["out"]["meta_info"]["finish_reason"]["type"] == "length"

    client.post("/pause_generation", json={"mode": "in_place"})
    t = threading.Thread(target=lambda: box.update(ab=_gen(
        client, input_ids=[4, 5, 6], rid="to-abort", sampling_params={"max_new_tokens": 3})))
    t.start()
    deadline = time.time() + 10
    while engine.scheduler.num_waiting == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert client.post("/abort_request", json={"rid": "to-abort"}).json()["num_aborted"] == 1
    t.join(timeout=30)
    client.post("/continue_generation")
    assert box["ab"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_bad_requests_name_the_field(server):
    _, client = server
    r = client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"temprature": 1.0}})
    assert r.status_code == 400 and "temprature" in r.text
    r = client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"repetition_penalty": 1.3}})
    assert r.status_code == 400 and "repetition_penalty" in r.text
    r = client.post("/generate", json={"input_ids": [1, 100000]})
    assert r.status_code == 400 and "vocabulary" in r.text


def test_control_token_required_when_set(model_dir):
    engine = Engine(str(model_dir))
    with TestClient(build_app(engine, token="s3cret")) as c:
        assert c.get("/health").status_code == 200
        assert c.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}).status_code == 200
        assert c.post("/flush_cache").status_code == 401
        assert c.post("/weights_checksum", json={}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = c.post("/weights_checksum", json={"names": ["lm_head.weight"]}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and len(ok.json()["checksums"]["lm_head.weight"]) == 32


def test_api_key_guards_every_route_but_health(model_dir):
    # SGLang's --api-key (mrl engine --api-key-env): /generate and the OpenAI routes need it too
    engine = Engine(str(model_dir))
    gen = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    with TestClient(build_app(engine, api_key="k3y")) as c:
        assert c.get("/health").status_code == 200
        for path, body in (("/generate", gen), ("/v1/completions", {"prompt": [1, 2], "max_tokens": 1})):
            assert c.post(path, json=body).status_code == 401
            assert c.post(path, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.post(path, json=body, headers={"Authorization": "Bearer k3y"}).status_code == 200


def test_logprobs_exact_when_rows_join_and_leave(model_dir):
    """Cache surgery (rows merged mid-run, finished rows dropped, padding columns cut) must not
    change any sequence's log-probs: every one equals transformers' on its own tokens."""
    engine, client = _client(model_dir, max_running=3)
    lengths = [3, 14, 6, 9, 2, 11]
    prompts = [PROMPTS[i % 4][: 2 + 3 * i] for i in range(len(lengths))]
    with client:
        outs = _gen(client, input_ids=prompts, return_logprob=True,
                    sampling_params=[{"temperature": 0.7, "max_new_tokens": n, "ignore_eos": True} for n in lengths])
        assert engine.scheduler.stats["admitted_while_running"] >= 2
    for prompt, out, n in zip(prompts, outs, lengths):
        assert len(out["output_ids"]) == n
        ref = _ref_logprobs(model_dir, prompt, out["output_ids"], 0.7)
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, ref, atol=1e-5, rtol=0), (got - ref).abs().max()


def test_request_ids_are_unique_32_hex_digits():
    from mrl.rollout.engine.scheduler import Request, new_rid
    from mrl.rollout.protocol import SamplingParams

    ids = {new_rid() for _ in range(1000)} | {Request([1], SamplingParams()).rid for _ in range(10)}
    assert len(ids) == 1010 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
