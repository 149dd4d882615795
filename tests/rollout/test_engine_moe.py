"""Mixture-of-experts models in the embedded engine: weights pushed under the HF checkpoint names (one tensor
per expert) land in transformers' fused expert parameters exactly, so the engine's logits equal those of the
model loaded from the same weights (disk, shared memory, in-process, torch.distributed); the engine answers per-expert
checksums (the inverse map)."""
from __future__ import annotations

import base64
import json
import threading
import time

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from mrl.rollout.engine.checksum import tensor_checksum
from mrl.rollout.engine.in_process import InProcessEngine
from mrl.rollout.engine.server import Engine, build_app
from tests.helpers.dist import free_port
from tests.helpers.shm import tensors_to_shm
from tests.helpers.tiny_moe_checkpoints import (
    FAMILIES,
    LAYERS,
    TOP_K,
    make_tiny_moe_hf,
    reference_topk,
)

PROMPTS = [[5, 17, 33, 41, 7, 9], [11, 3, 70]]


def _reference_logits(path, prompts) -> torch.Tensor:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1] for p in prompts])


def _engine_logits(engine: Engine, prompts) -> torch.Tensor:
    with engine.scheduler.model_lock:
        return engine.runner.prefill(prompts)[1].clone()


def _assert_holds(engine: Engine, src: dict[str, torch.Tensor]) -> None:
    views = engine.runner.named_weights()
    assert set(views) == set(src)  # every checkpoint name, nothing else
    for name, t in src.items():
        assert torch.equal(views[name], t), name


@pytest.mark.parametrize("family", FAMILIES)
def test_update_from_disk_gives_the_logits_of_the_loaded_model(tmp_path, family):
    a, b = make_tiny_moe_hf(tmp_path / "a", family, seed=0), make_tiny_moe_hf(tmp_path / "b", family, seed=1)
    src = load_file(str(b / "model.safetensors"))
    ref = _reference_logits(b, PROMPTS)
    engine = Engine(str(a))
    with TestClient(build_app(engine)) as c:
        assert not torch.allclose(_engine_logits(engine, PROMPTS), ref, atol=1e-3)
        r = c.post("/update_weights_from_disk", json={"model_path": str(b)}).json()
        assert r["success"], r
        _assert_holds(engine, src)
        torch.testing.assert_close(_engine_logits(engine, PROMPTS), ref, rtol=0, atol=1e-5)
        sums = c.post("/weights_checksum", json={"names": list(src)}).json()["checksums"]
        assert sums == {n: tensor_checksum(t) for n, t in src.items()}
        e0 = next(n for n in src if ".experts.0." in n)
        got = c.post("/get_weights_by_name", json={"name": e0, "truncate_size": 2}).json()
        assert torch.equal(torch.tensor(got), src[e0][:2])


def test_update_from_shared_memory_and_in_process(tmp_path):
    a, b = make_tiny_moe_hf(tmp_path / "a", "mixtral", seed=0), make_tiny_moe_hf(tmp_path / "b", "mixtral", seed=1)
    src = load_file(str(b / "model.safetensors"))
    ref = _reference_logits(b, PROMPTS)
    shm, specs = tensors_to_shm(src)
    try:
        engine = Engine(str(a))
        with TestClient(build_app(engine)) as c:
            assert c.post("/begin_weight_update", json={}).json()["success"]
            r = c.post("/update_weights_from_tensor", json={"shm_tensors": specs}).json()
            assert r["success"], r
            _assert_holds(engine, src)
            torch.testing.assert_close(_engine_logits(engine, PROMPTS), ref, rtol=0, atol=1e-5)
    finally:
        shm.close()
        shm.unlink()
    # the trainer rank's in-process load (verify compares checksums of the per-expert views)
    eng = InProcessEngine(str(a), host="127.0.0.1", port=free_port(), token=None, dtype="float32", seed=0)
    try:
        _, n = eng.load_weights(sorted(src.items()), "3", verify=True, timeout_s=30)
        assert n == len(src)
        _assert_holds(eng.engine, src)
        torch.testing.assert_close(_engine_logits(eng.engine, PROMPTS), ref, rtol=0, atol=1e-5)
        with pytest.raises(KeyError, match="not a parameter"):  # the fused in-memory name is not a checkpoint name
            eng.load_weights([("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(1))], "4", verify=False,
                             timeout_s=10)
    finally:
        eng.stop()


def test_release_resume_keeps_the_expert_views(tmp_path):
    """After /release_memory_occupation the parameters hold new storage: names map to the new tensors."""
    a = make_tiny_moe_hf(tmp_path / "a", "qwen3_moe", seed=0)
    src = load_file(str(a / "model.safetensors"))
    engine = Engine(str(a))
    with TestClient(build_app(engine)) as c:
        before = _engine_logits(engine, PROMPTS)
        assert c.post("/release_memory_occupation", json={}).json()["success"]
        assert c.post("/resume_memory_occupation", json={}).json()["success"]
        _assert_holds(engine, src)
        assert torch.equal(_engine_logits(engine, PROMPTS), before)


def test_routed_experts_flag_on_a_dense_model_is_refused(tmp_path):
    from tests.helpers.tiny_models import make_tiny_hf

    path = make_tiny_hf(tmp_path / "d", "qwen2")
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        Engine(str(path), enable_return_routed_experts=True)


def _decode(s: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.int32).copy()).view(-1, LAYERS, TOP_K)


def test_routed_experts_streamed_at_the_end_and_kept_across_a_retract(tmp_path):
    """Streaming: only the final event carries them (SGLang collects them when the request finishes). A
    request retracted mid-generation (pause_generation retract, then continue) is re-prefilled over prompt +
    tokens so far; its routed experts still cover every fed token and match the oracle."""
    import transformers as tf

    path = make_tiny_moe_hf(tmp_path / "m", "qwen3_moe", seed=4)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine(str(path), enable_return_routed_experts=True)
    greedy = {"temperature": 0, "max_new_tokens": 120, "ignore_eos": True}
    with TestClient(build_app(engine)) as c:
        with c.stream("POST", "/generate", json={"input_ids": PROMPTS[0], "sampling_params": {**greedy, "max_new_tokens": 4},
                                                 "return_routed_experts": True, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert len(events) >= 2 and all("routed_experts" not in e["meta_info"] for e in events[:-1])
        last = events[-1]
        tokens = PROMPTS[0] + last["output_ids"]
        assert torch.equal(_decode(last["meta_info"]["routed_experts"]), reference_topk(model, tokens[:-1]))

        box: dict = {}
        t = threading.Thread(target=lambda: box.update(r=c.post("/generate", json={
            "input_ids": PROMPTS[1], "sampling_params": greedy, "return_routed_experts": True}).json()))
        t.start()
        sched = engine.scheduler
        deadline = time.monotonic() + 60
        while True:  # checked and retracted under the model lock (between two steps): no race with its end
            with sched.model_lock:
                if any(len(r.output_ids) >= 3 for r in sched._rows):
                    assert sched.pause("retract") == 1 and sched.stats["retracted"] == 1
                    break
            assert time.monotonic() < deadline and t.is_alive(), "generation never got going (or ended unseen)"
            time.sleep(0.001)
        sched.resume()
        t.join(60)
        out = box["r"]
        assert len(out["output_ids"]) == 120 and sched.stats["prefill_batches"] >= 3  # re-prefilled
        tokens = PROMPTS[1] + out["output_ids"]
        assert torch.equal(_decode(out["meta_info"]["routed_experts"]), reference_topk(model, tokens[:-1]))


def _dist_rank(rank, world_size, port, a, b):
    """rank 0: the trainer-side sender of b's per-expert tensors (one flattened bucket); rank 1: an engine on a."""
    import torch.distributed as dist

    from mrl.rollout.weight_sync.group import init_custom_process_group

    src = load_file(str(b / "model.safetensors"))
    if rank == 0:
        pg = init_custom_process_group("gloo", "127.0.0.1", port, 0, 2, "weight_update_group", timeout_s=60)
        dist.broadcast(torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in src.values()]), group=pg,
                       group_src=0)
        return None
    engine = Engine(str(a))
    with TestClient(build_app(engine)) as c:
        r = c.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": port,
                                                       "rank_offset": 1, "world_size": 2, "backend": "gloo"}).json()
        assert r["success"], r
        assert c.post("/begin_weight_update", json={}).json()["success"]
        names = list(src)
        r = c.post("/update_weights_from_distributed", json={
            "names": names, "dtypes": ["float32"] * len(names), "shapes": [list(src[n].shape) for n in names],
            "load_format": "flattened_bucket"}).json()
        assert r["success"], r
        _assert_holds(engine, src)
        return _engine_logits(engine, PROMPTS)


@pytest.mark.multirank
def test_update_from_distributed_gives_the_logits_of_the_loaded_model(tmp_path):
    from tests.helpers.dist import run_ranks

    a, b = make_tiny_moe_hf(tmp_path / "a", "qwen3_moe", seed=0), make_tiny_moe_hf(tmp_path / "b", "qwen3_moe", seed=1)
    _, logits = run_ranks(_dist_rank, 2, args=(free_port(), a, b), timeout_s=150, init_process_group=False)
    torch.testing.assert_close(logits, _reference_logits(b, PROMPTS), rtol=0, atol=1e-5)


def test_gpt_oss_serves_updates_and_returns_routed_experts(tmp_path):
    """gpt-oss (fused experts under the parameters' own names, router ``mlp.router``, attention sinks, a 4-token
    window on layer 0): a disk update gives the loaded model's logits and checksums; greedy generation past the
    window (the transformers-forward decode path) gives transformers' own greedy tokens, and the routed experts of
    every fed token match the oracle."""
    import transformers as tf

    from tests.helpers.tiny_moe_checkpoints import GPT_OSS

    a, b = make_tiny_moe_hf(tmp_path / "a", GPT_OSS, seed=0), make_tiny_moe_hf(tmp_path / "b", GPT_OSS, seed=1)
    src = load_file(str(b / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in src and "model.layers.0.mlp.router.bias" in src
    ref = _reference_logits(b, PROMPTS)
    engine = Engine(str(a), enable_return_routed_experts=True)
    assert engine.runner.decode_path.startswith("transformers forward (")
    with TestClient(build_app(engine)) as c:
        assert not torch.allclose(_engine_logits(engine, PROMPTS), ref, atol=1e-3)
        r = c.post("/update_weights_from_disk", json={"model_path": str(b)}).json()
        assert r["success"], r
        _assert_holds(engine, src)
        torch.testing.assert_close(_engine_logits(engine, PROMPTS), ref, rtol=0, atol=1e-5)
        sums = c.post("/weights_checksum", json={"names": list(src)}).json()["checksums"]
        assert sums == {n: tensor_checksum(t) for n, t in src.items()}
        model = tf.AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).eval()
        for prompt in PROMPTS:
            out = c.post("/generate", json={"input_ids": prompt, "return_routed_experts": True, "sampling_params": {
                "temperature": 0, "max_new_tokens": 10, "ignore_eos": True}}).json()
            want = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10)
            assert out["output_ids"] == want[0, len(prompt):].tolist()
            tokens = prompt + out["output_ids"]
            assert torch.equal(_decode(out["meta_info"]["routed_experts"]), reference_topk(model, tokens[:-1]))
def test_glm_routed_experts_come_from_the_biased_sigmoid_router(tmp_path):
    """GLM-4.5 (``Glm4MoeTopkRouter``: top-k of sigmoid + score-correction bias, layer 0 dense): the engine
    captures its routers in prefill and fast-path decode, and the ids equal the oracle's top-k as sets (the
    router's top-k is unsorted; replay uses the set); the dense layer's rows are 0."""
    import transformers as tf

    path = make_tiny_moe_hf(tmp_path / "g", "glm4_moe", seed=2)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine(str(path), enable_return_routed_experts=True)
    assert engine.runner.decode_path == "fast"
    with TestClient(build_app(engine)) as c:
        out = c.post("/generate", json={"input_ids": PROMPTS[0], "return_routed_experts": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}).json()
    tokens = PROMPTS[0] + out["output_ids"]
    got = _decode(out["meta_info"]["routed_experts"])
    ref = reference_topk(model, tokens[:-1])
    assert got.shape == ref.shape == (len(tokens) - 1, LAYERS, TOP_K)
    assert torch.equal(got.sort(-1).values, ref.sort(-1).values)
    assert not got[:, 0].any() and got[:, 1].any()
    # the bias decides: without it the oracle's choice differs somewhere (else the test could not tell)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]]), output_router_logits=True).router_logits[0]
    unbiased = torch.topk(torch.sigmoid(logits.float()), TOP_K, dim=-1).indices.sort(-1).values
    assert not torch.equal(unbiased, ref[:, 1].sort(-1).values.long())
