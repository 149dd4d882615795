"""Hybrid models (Gated DeltaNet linear attention + gated full attention) in the embedded engine, against plain
transformers forwards: Qwen3.5 in its released vision-language form and its text-only form, Qwen3.5-MoE, Qwen3-Next.

Tolerance (fp32 logits and log-probs): ``TOL = 1e-4`` dense, ``TOL_MOE = 3e-4`` MoE. The reference is one unpadded
forward of each whole sequence (transformers' chunked delta rule); the engine prefills left-padded batches (other
GEMM shapes, the chunks shifted by the padding) and decodes with the recurrent form, one token at a time: the same
sums in other orders, so the two differ by rounding at every GEMM and delta-rule step. How far one rounding travels
was measured on these models: a random relative perturbation of about one unit in the last place (1.2e-7) at the
output of one linear-attention mixer, MLP or gated norm moves the logits (|z| <= 3) by 1e-6 to 3e-6, at the
embeddings by 7e-6 (a tiny Qwen3's embeddings: 1.3e-6), and the engine-vs-reference differences have heavy tails:
over 25 model/schedule runs (10 dense, 15 MoE) the dense kinds' median was 5e-6 and their worst 3.7e-5; the MoE kinds (the router's
softmax over logits up to ~20 passes a rounding on into the expert weights) median 1e-5, worst 1.06e-4. The bounds
sit 2.7x above those worst cases. Every fault below (a state not moved with its row, the conv window shifted by
one, padding not masked, the recurrent state not carried) moves the logits by > 1, four orders of magnitude more.
"""
from __future__ import annotations

import random

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from mrl.rollout.engine import kv_cache
from mrl.rollout.engine.decode import fast_path_refusal
from mrl.rollout.engine.model_runner import ModelRunner
from mrl.rollout.engine.server import Engine, build_app
from mrl.rollout.engine.weights import check_named, load_into_model
from tests.helpers.tiny_hybrid import (
    KINDS,
    LAYERS,
    MOE_KINDS,
    TOP_K,
    VOCAB,
    hybrid_config,
    make_tiny_hybrid_hf,
    reference_topk,
)

TOL = 1e-4
TOL_MOE = 3e-4


def _tol(kind: str) -> float:
    return TOL_MOE if kind in MOE_KINDS else TOL


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {k: make_tiny_hybrid_hf(root / k, k, seed=3) for k in KINDS}


def _last_logits(model, seqs: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([s])).logits[0, -1] for s in seqs])


def _schedule(runner: ModelRunner, tol: float, seed: int = 0) -> int:
    """Two admission waves of ragged prompts (one longer than a 64-position chunk, two identical ones: a row copy),
    rows removed at random steps (swap-remove moves the last row's states), buffers reallocated every few steps;
    every step's logits of every row against an unpadded forward. Returns the number of row-steps checked."""
    rng = random.Random(seed)
    rb, seqs, checked = runner.new_batch(), [], 0
    for lengths in ((1, 7, 70, 3, 7), (2, 12, 5)):
        prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]
        if lengths[-1] == 7:
            prompts[-1] = list(prompts[1])  # identical prompts: computed once, the row (and its states) copied
        rows, logits = runner.prefill(prompts)
        assert (logits - _last_logits(runner.model, prompts)).abs().max() <= tol
        nxt = torch.tensor([rng.randrange(3, VOCAB) for _ in prompts])
        rb.add(rows, last_tokens=nxt)
        seqs += [p + [int(t)] for p, t in zip(prompts, nxt)]
        for _ in range(5):
            logits = runner.decode(rb)
            err = (logits - _last_logits(runner.model, seqs)).abs().max()
            assert err <= tol, err
            checked += len(seqs)
            nxt = [rng.randrange(3, VOCAB) for _ in seqs]
            rb.last_tokens = torch.tensor(nxt)
            seqs = [s + [t] for s, t in zip(seqs, nxt)]
            done = [i for i in range(len(seqs)) if rng.random() < 0.2]
            if done and len(done) < len(seqs):
                order = rb.remove(done)
                seqs = [seqs[i] for i in order]
                assert rb.next_pos.tolist() == [len(s) - 1 for s in seqs]
    return checked


@pytest.mark.parametrize("kind", KINDS)
def test_decode_with_recurrent_state_matches_transformers(model_dirs, kind, monkeypatch):
    monkeypatch.setattr(kv_cache, "COL_HEADROOM", 3)  # reallocate (row states carried over) every few steps
    runner = ModelRunner(str(model_dirs[kind]))
    assert runner.decode_path.startswith("transformers forward (hybrid")
    assert len(runner.hybrid.full) == 1 and len(runner.hybrid.linear) == LAYERS - 1
    assert _schedule(runner, _tol(kind)) > 25


def test_fast_path_refuses_hybrids_with_the_reason():
    for kind in KINDS:
        assert "linear-attention layers" in fast_path_refusal(hybrid_config(kind))


def test_running_batch_row_states_move_with_their_rows():
    """Row states are written by add (repeats from select), moved by swap-remove, kept by a reallocation."""
    rb = kv_cache.RunningBatch(1, 1, 2, dtype=torch.float32, device=torch.device("cpu"),
                               row_states=[((3,), torch.float32), ((2, 2), torch.float64)])
    n = 4
    keys = torch.zeros(n, 1, 2, 2)
    conv = torch.arange(n, dtype=torch.float32)[:, None].expand(n, 3).contiguous()
    rec = torch.arange(n, dtype=torch.float64)[:, None, None].expand(n, 2, 2).contiguous()
    rows = kv_cache.PrefilledRows([keys], [keys.clone()], torch.ones(n, 2, dtype=torch.long),
                                  torch.full((n,), 2), [conv, rec]).select(torch.tensor([0, 1, 2, 3, 1]))
    rb.add(rows, last_tokens=torch.zeros(5, dtype=torch.long))
    assert rb.state(0)[:, 0].tolist() == [0, 1, 2, 3, 1] and rb.state(1).dtype == torch.float64
    order = rb.remove([0])  # the last row (a copy of 1) moves into slot 0
    assert order == [4, 1, 2, 3] and rb.state(0)[:, 0].tolist() == [1, 1, 2, 3]
    rb.add(kv_cache.PrefilledRows([keys], [keys.clone()], torch.ones(n, 2, dtype=torch.long), torch.full((n,), 2),
                                  [conv + 10, rec + 10]), last_tokens=torch.zeros(n, dtype=torch.long))  # past rows_cap
    assert rb.state(0)[:, 2].tolist() == [1, 1, 2, 3, 10, 11, 12, 13]
    assert rb.state(1)[:, 1, 1].tolist() == [1, 1, 2, 3, 10, 11, 12, 13]


def test_bfloat16_engine_keeps_the_recurrent_state_in_fp32(model_dirs):
    """In bf16 the conv window is the conv's input dtype (bf16) and the recurrent state stays fp32, as transformers
    keeps it (its delta rule computes in fp32); the bf16 decode follows the bf16 transformers forward."""
    runner = ModelRunner(str(model_dirs["qwen3_5_text"]), dtype="bfloat16")
    rows, _ = runner.prefill([[5, 17, 33, 41], [11, 3]])
    assert [s.dtype for s in rows.states] == [torch.bfloat16, torch.float32] * (LAYERS - 1)
    rb = runner.new_batch()
    rb.add(rows, last_tokens=torch.tensor([7, 9]))
    assert [s.dtype for s in rb.s] == [torch.bfloat16, torch.float32] * (LAYERS - 1)
    logits = runner.decode(rb).float()
    ref = _last_logits(runner.model, [[5, 17, 33, 41, 7], [11, 3, 9]]).float()
    # bf16 (8 bits of mantissa): two summation orders of logits <= 3 differ by a few units of 2^-8 * 3
    assert (logits - ref).abs().max() <= 0.1


def _generate(client, prompts, max_new):
    r = client.post("/generate", json={
        "input_ids": prompts, "return_logprob": True,
        "sampling_params": [{"temperature": 0, "max_new_tokens": m, "ignore_eos": True} for m in max_new]})
    assert r.status_code == 200, r.text
    return r.json()


def test_engine_greedy_generation_and_logprobs_match_transformers(model_dirs):
    """One /generate of prompts of different lengths (left-padded prefill), two identical prompts (row copy), rows
    finishing at different steps (removal): greedy tokens are transformers' argmax and the returned log-probs of the
    sampled tokens equal log_softmax of one plain forward over prompt + response."""
    path = model_dirs["qwen3_5"]
    engine = Engine(str(path))
    prompts = [[5, 17, 33, 41, 7, 9, 11, 13], [11, 3, 70], [11, 3, 70], [8] * 1 + [200, 150, 99, 4] * 5, [42]]
    max_new = [9, 4, 12, 6, 10]
    model = engine.runner.model
    with TestClient(build_app(engine)) as c:
        outs = _generate(c, prompts, max_new)
    assert engine.scheduler.stats["prefill_batches"] == 1 and engine.scheduler.stats["prefilled_unique_prompts"] == 4
    for prompt, n, out in zip(prompts, max_new, outs):
        ids = out["output_ids"]
        assert len(ids) == n
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        assert ids == logits.argmax(-1).tolist()  # greedy: every token is the plain forward's argmax
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert (got - ref).abs().max() <= TOL, (got - ref).abs().max()
    assert outs[1]["output_ids"] == outs[2]["output_ids"][:4]


@pytest.mark.parametrize("kind", KINDS)
def test_weights_are_held_under_the_checkpoint_names_and_updates_land(model_dirs, tmp_path, kind):
    """The engine's names are the safetensors names (the VL form: model.language_model.*, model.visual.*,
    lm_head.weight; MoE experts one tensor per expert); an update from disk gives the other checkpoint's logits,
    and one linear-attention tensor pushed by name changes the output."""
    a = model_dirs[kind]
    b = make_tiny_hybrid_hf(tmp_path / "b", kind, seed=4)
    src = load_file(str(b / "model.safetensors"))
    prompts = [[5, 17, 33, 41, 7, 9], [11, 3, 70]]
    engine = Engine(str(a))
    assert set(engine.runner.weight_meta()) == set(src)
    if kind in ("qwen3_5", "qwen3_5_moe"):
        assert any(n.startswith("model.visual.") for n in src)
        assert any(n.startswith("model.language_model.layers.0.linear_attn.") for n in src)
    import transformers as tf

    ref_model = (tf.AutoModelForImageTextToText if kind in ("qwen3_5", "qwen3_5_moe")
                 else tf.AutoModelForCausalLM).from_pretrained(b, dtype=torch.float32).eval()
    with TestClient(build_app(engine)) as c:
        r = c.post("/update_weights_from_disk", json={"model_path": str(b)}).json()
        assert r["success"], r
        with engine.scheduler.model_lock:
            got = engine.runner.prefill(prompts)[1].clone()
        assert (got - _last_logits(ref_model, prompts)).abs().max() <= _tol(kind)
        a_log = next(n for n in src if n.endswith("layers.0.linear_attn.A_log"))
        with engine.scheduler.model_lock:
            load_into_model(engine.runner, check_named(engine.runner, [(a_log, src[a_log] + 1.0)]))
            moved = engine.runner.prefill(prompts)[1]
        assert (moved - got).abs().max() > 1e-3


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_routed_experts_match_transformers_router(model_dirs, kind):
    import base64

    import numpy as np

    engine = Engine(str(model_dirs[kind]), enable_return_routed_experts=True)
    prompts = [[5, 17, 33, 41, 7, 9], [11, 3, 70]]
    with TestClient(build_app(engine)) as c:
        r = c.post("/generate", json={"input_ids": prompts, "return_routed_experts": True,
                                      "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}})
        outs = r.json()
    for prompt, out in zip(prompts, outs):
        tokens = prompt + out["output_ids"]
        raw = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32).copy()
        got = torch.from_numpy(raw).view(-1, LAYERS, TOP_K)
        assert torch.equal(got, reference_topk(engine.runner.model, tokens[:-1]))
