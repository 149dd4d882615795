"""Partial rollouts against the real embedded engine (uvicorn in this process, tiny random Llama):
a weight push in the middle of the generations aborts them (``/pause_generation`` abort), the
tokens so far are kept with the version that made them, and the samples are continued with the
new weights. Oracle: transformers' log-probs of every response token under the model of the
version the token is labelled with, given the full concatenated prefix — a lost, repeated or
mislabelled token would not match."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path

import pytest
import torch
import uvicorn
from transformers import AutoModelForCausalLM

from mrl.rollout.client import RolloutClient
from mrl.rollout.engine.server import Engine, build_app
from mrl.rollout.partial import SubmitGate, agenerate_resumable
from mrl.rollout.pool import EngineEndpoint, EnginePool
from mrl.rollout.router import Router
from mrl.rollout.types import RolloutRequest
from tests.helpers.dist import free_port
from tests.helpers.tiny_models import make_tiny_hf

PROMPTS = [[5, 17, 33, 101, 7], [9, 10, 11], [200, 3, 4, 5, 6, 7, 8]]
N, BUDGET = 2, 120


@contextlib.contextmanager
def _serve(engine: Engine):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "engine server did not start in 60 s"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _push(pool: EnginePool, gate: SubmitGate, model_dir: Path, version: str) -> None:
    """What the async producer's push does around the weight sync (mrl/driver/async_rollout.py)."""
    gate.close()
    pool.pause(mode="abort")
    assert gate.wait_drained(30, poke=lambda: pool.control("/abort_request", {"abort_all": True}))
    pool.control("/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": version})
    pool.resume()
    gate.open()


def _hf_logprobs(model_dir: Path, prompt: list[int], response: list[int]) -> torch.Tensor:
    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = m(ids).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_push_mid_generation_keeps_every_token_with_its_version(tmp_path: Path) -> None:
    a = make_tiny_hf(tmp_path / "a", "llama", seed=0)
    b = make_tiny_hf(tmp_path / "b", "llama", seed=1)  # "version 1": other weights
    engine = Engine(str(a), max_running=4)  # 6 samples, 4 slots: some wait in the queue at the push
    with _serve(engine) as url:
        pool = EnginePool([EngineEndpoint(url)], health_interval_s=0)
        try:
            client, gate = RolloutClient(Router(pool)), SubmitGate()
            seeds = [[100 * i + j for j in range(N)] for i in range(len(PROMPTS))]
            req = RolloutRequest(PROMPTS, n=N, sampling_params={"temperature": 1.0, "max_new_tokens": BUDGET,
                                                               "ignore_eos": True}, sampling_seeds=seeds, timeout_s=120)
            fut = asyncio.run_coroutine_threadsafe(agenerate_resumable(client, req, gate, gate_timeout_s=60), pool.loop.loop)
            deadline = time.time() + 60  # push once some samples have tokens and none has finished
            while not any(len(r.output_ids) >= 5 for r in list(engine.scheduler._rows)):
                assert time.time() < deadline and not fut.done(), "generation never got going"
                time.sleep(0.001)
            _push(pool, gate, b, "1")
            res, sent = fut.result(timeout=120)
        finally:
            pool.close()
    assert not res.failed and sent >= 1
    split = 0
    for s in res.samples:
        assert s.response_length == BUDGET and s.finish_reason == "length"  # nothing lost or repeated
        v = s.token_weight_versions
        assert len(v) == BUDGET and set(v) <= {"default", "1"}
        k = v.count("default")
        assert v == ["default"] * k + ["1"] * (BUDGET - k)  # old tokens, then new ones, never mixed
        assert s.weight_version == ("default" if k else "1")  # a sample's version: its oldest token's
        split += 0 < k < BUDGET
        got = torch.tensor(s.rollout_log_probs)
        prompt = PROMPTS[s.prompt_index]
        want = torch.cat([_hf_logprobs(a, prompt, s.response_ids)[:k], _hf_logprobs(b, prompt, s.response_ids)[k:]])
        assert torch.allclose(got, want, atol=1e-4), (s.prompt_index, k, (got - want).abs().max())
        if 0 < k < BUDGET:  # the continuation really used the new weights: model a disagrees there
            wrong = _hf_logprobs(a, prompt, s.response_ids)[k:]
            assert (got[k:] - wrong).abs().max() > 1e-2
    assert split >= 1, [s.token_weight_versions.count("default") for s in res.samples]


def test_gate_holds_segments_while_closed() -> None:
    gate = SubmitGate()
    gate.close()

    async def enter() -> float:
        t0 = time.monotonic()
        await gate.enter(10)
        return time.monotonic() - t0

    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(enter())
        threading.Timer(0.3, gate.open).start()
        waited = loop.run_until_complete(task)
    finally:
        loop.close()
    assert waited >= 0.25 and gate.inflight == 1
    assert not gate.wait_drained(0.1)  # one segment in flight
    gate.leave()
    assert gate.wait_drained(0.1)
    gate.close()
    with pytest.raises(TimeoutError, match="batch_timeout_s"):
        asyncio.run(gate.enter(0.05))
