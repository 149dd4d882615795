"""The embedded engine served from threads of the caller's process (rollout.weight_sync.transport=inprocess):
real HTTP on a real port, and weight loads that change generations, bump the version, check names and
shapes before copying, and wait for running requests."""
from __future__ import annotations

import threading

import httpx
import pytest
import torch
from safetensors.torch import load_file

from mrl.rollout.engine.in_process import InProcessEngine
from tests.helpers.dist import free_port
from tests.helpers.tiny_models import make_tiny_hf

PROMPT = [5, 17, 33, 101, 7, 9]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def _greedy(url: str) -> list[int]:
    r = httpx.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}, timeout=60)
    r.raise_for_status()
    return r.json()["output_ids"]


def test_in_process_engine_serves_and_loads_weights(tmp_path):
    a, b = make_tiny_hf(tmp_path / "a", "qwen2", seed=0), make_tiny_hf(tmp_path / "b", "qwen2", seed=1)
    new = sorted(load_file(str(b / "model.safetensors")).items())
    eng = InProcessEngine(str(a), host="127.0.0.1", port=free_port(), token="t0k", dtype="float32", seed=0)
    try:
        before = _greedy(eng.url)
        assert httpx.post(f"{eng.url}/flush_cache", timeout=10).status_code == 401  # control routes need the token
        moved, n = eng.load_weights(new, "7", verify=True, timeout_s=10)
        assert n == len(new) and moved == sum(t.numel() * t.element_size() for _, t in new)
        after = _greedy(eng.url)
        assert after != before
        assert httpx.get(f"{eng.url}/get_weight_version", timeout=10).json()["weight_version"] == "7"
        # the same weights served by an engine that loaded them from disk answer the same
        ref = InProcessEngine(str(b), host="127.0.0.1", port=free_port(), token=None, dtype="float32", seed=0)
        try:
            assert _greedy(ref.url) == after
        finally:
            ref.stop()
        # a bad name or shape fails the load before anything is copied
        w0 = eng.engine.runner.named_weights()["lm_head.weight"].clone()
        with pytest.raises(KeyError, match="not a parameter"):
            eng.load_weights([("lm_head.weight", torch.zeros_like(w0)), ("nope", torch.zeros(1))], "8",
                             verify=False, timeout_s=10)
        with pytest.raises(ValueError, match="shape"):
            eng.load_weights([("lm_head.weight", torch.zeros(3, 3))], "8", verify=False, timeout_s=10)
        assert torch.equal(eng.engine.runner.named_weights()["lm_head.weight"], w0)
        assert eng.engine.scheduler.weight_version == "7"
        # a load waits while a request runs: a long request, held between two decode steps by the model lock
        long = {"temperature": 0, "max_new_tokens": 240, "ignore_eos": True}
        t = threading.Thread(target=lambda: httpx.post(f"{eng.url}/generate", json={"input_ids": PROMPT,
                                                                                  "sampling_params": long}, timeout=120))
        t.start()
        sched = eng.engine.scheduler
        try:
            while sched.num_running == 0:
                threading.Event().wait(0.001)
            with sched.model_lock:  # re-entrant: load_weights takes it again on this thread
                assert sched.num_running == 1
                with pytest.raises(TimeoutError, match="still busy"):
                    eng.load_weights(new, "9", verify=False, timeout_s=0.2)
        finally:
            t.join(120)
        assert eng.engine.scheduler.weight_version == "7"
    finally:
        eng.stop()
    assert not eng._thread.is_alive()
