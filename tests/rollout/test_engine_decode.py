"""Decode step and KV cache of the embedded engine against an unpadded transformers forward.

Every step's logits of every running row must equal the logits of ``model(prompt + generated)``
at its last position (fp32, max |diff| <= 1e-5), while rows of different lengths join, finish
(swap-remove) and the buffers are reallocated (tiny column headroom forces it every few steps).
Both decode implementations are checked: the written-out llama-family step and the generic one
through the model's own forward.
"""
from __future__ import annotations

import random

import pytest
import torch

from mrl.rollout.engine import kv_cache
from mrl.rollout.engine.decode import fast_path_refusal
from mrl.rollout.engine.kv_cache import RunningBatch
from mrl.rollout.engine.model_runner import ModelRunner
from tests.helpers.tiny_models import hf_config, make_tiny_hf
from tests.helpers.tiny_moe_checkpoints import FAMILIES as MOE_FAMILIES
from tests.helpers.tiny_moe_checkpoints import make_tiny_moe_hf

TOL = 1e-5


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode")
    dirs = {f: make_tiny_hf(root / f, f) for f in ("llama", "qwen2", "qwen3", "mistral")}
    dirs.update({f: make_tiny_moe_hf(root / f, f) for f in MOE_FAMILIES})  # Qwen3-MoE, Mixtral, Qwen2-MoE
    # llama with biases on q/k/v/o and the MLP: exercises the fused bias buffers
    dirs["llama_bias"] = make_tiny_hf(root / "llama_bias", "llama", attention_bias=True, mlp_bias=True)
    return dirs


def _reference_last_logits(model, seqs: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([s])).logits[0, -1] for s in seqs])


def _run_schedule(runner: ModelRunner, seed: int = 0) -> int:
    """Admit rows of ragged prompt lengths in 3 waves, finish rows at random steps, and compare
    every step's logits with the reference. Returns the number of rows checked."""
    rng = random.Random(seed)
    vocab = runner.config.vocab_size
    rb = runner.new_batch()
    seqs: list[list[int]] = []  # row-aligned with rb: prompt + tokens fed so far
    checked = 0
    for wave, n_new in enumerate((5, 3, 4)):
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 12 + 8 * wave))] for _ in range(n_new)]
        rows, logits = runner.prefill(prompts)
        ref = _reference_last_logits(runner.model, prompts)
        assert (logits - ref).abs().max() <= TOL
        nxt = torch.tensor([rng.randrange(3, vocab) for _ in prompts])
        rb.add(rows, last_tokens=nxt)
        seqs += [p + [int(t)] for p, t in zip(prompts, nxt)]
        for _ in range(6):
            logits = runner.decode(rb)
            ref = _reference_last_logits(runner.model, seqs)
            assert logits.shape == ref.shape
            assert (logits - ref).abs().max() <= TOL, (logits - ref).abs().max()
            checked += len(seqs)
            nxt = [rng.randrange(3, vocab) for _ in seqs]
            rb.last_tokens = torch.tensor(nxt)
            seqs = [s + [t] for s, t in zip(seqs, nxt)]
            done = [i for i in range(len(seqs)) if rng.random() < 0.15]
            if done and len(done) < len(seqs):
                order = rb.remove(done)
                seqs = [seqs[i] for i in order]
                assert rb.next_pos.tolist() == [len(s) - 1 for s in seqs]
    return checked


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "llama_bias", *MOE_FAMILIES])
def test_fast_decode_matches_transformers(model_dirs, family, monkeypatch):
    monkeypatch.setattr(kv_cache, "COL_HEADROOM", 3)  # reallocate every few steps
    runner = ModelRunner(str(model_dirs[family]))
    assert runner.decode_path == "fast"
    assert _run_schedule(runner) > 40


def _decode_once(runner: ModelRunner, prompts: list[list[int]], nxt: list[int]) -> torch.Tensor:
    rb = runner.new_batch()
    rows, _ = runner.prefill(prompts)
    rb.add(rows, last_tokens=torch.tensor(nxt))
    return runner.decode(rb)


def test_weight_updates_reach_the_fused_fast_path(model_dirs):
    """An update by HF name (the copy every /update_weights_* endpoint does) and a release/resume
    + reload must both show up in the fast path's logits, which must keep matching the model's own
    forward (guards any weight the decoder might cache: fused, packed or transposed copies)."""
    from mrl.rollout.engine.weights import load_into_model, read_disk

    runner = ModelRunner(str(model_dirs["llama_bias"]))
    assert runner.decode_path == "fast"
    prompts, nxt = [[5, 6, 7, 8], [9, 10]], [11, 12]
    seqs = [p + [t] for p, t in zip(prompts, nxt)]
    before = _decode_once(runner, prompts, nxt)
    assert (before - _reference_last_logits(runner.model, seqs)).abs().max() <= TOL

    names = [f"model.layers.{i}.{m}.{w}" for i in (0, 3) for m in ("self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj") for w in ("weight", "bias")]
    params = runner.named_weights()
    gen = torch.Generator().manual_seed(0)
    load_into_model(runner, [(n, 0.1 * torch.randn(params[n].shape, generator=gen)) for n in names])
    updated = _decode_once(runner, prompts, nxt)
    assert (updated - before).abs().max() > 1e-2  # the update reached the step
    assert (updated - _reference_last_logits(runner.model, seqs)).abs().max() <= TOL

    runner.release()
    runner.resume()  # fresh zero storage: the next step must not use anything cached before
    load_into_model(runner, read_disk(runner, str(model_dirs["llama_bias"])))
    restored = _decode_once(runner, prompts, nxt)
    assert (restored - before).abs().max() <= TOL
    assert (restored - _reference_last_logits(runner.model, seqs)).abs().max() <= TOL


@pytest.mark.parametrize("family", ["qwen2", "qwen2_moe"])
def test_generic_decode_matches_transformers(model_dirs, family, monkeypatch):
    monkeypatch.setattr(kv_cache, "COL_HEADROOM", 3)
    runner = ModelRunner(str(model_dirs[family]))
    runner._decoder = None  # the model's own forward over views of the cache
    assert _run_schedule(runner, seed=1) > 40


def test_fast_path_refuses_what_it_does_not_implement():
    assert fast_path_refusal(hf_config("qwen2")) is None
    assert "sliding" in fast_path_refusal(hf_config("mistral", sliding_window=16))
    assert "sliding" in fast_path_refusal(hf_config("qwen2", use_sliding_window=True, sliding_window=16,
                                                    max_window_layers=0))
    import transformers as tf

    assert "gpt2" in fast_path_refusal(tf.GPT2Config())
    from tests.helpers.tiny_moe_checkpoints import moe_config

    assert all(fast_path_refusal(moe_config(f)) is None for f in MOE_FAMILIES)
    assert "sliding" in fast_path_refusal(moe_config("mixtral", sliding_window=16))


def _batch_with(rows: int, lengths: list[int]) -> RunningBatch:
    rb = RunningBatch(num_layers=2, kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))
    lp = max(lengths)
    valid = torch.zeros(rows, lp, dtype=torch.long)
    keys = torch.zeros(rows, 1, lp, 2)
    for r, n in enumerate(lengths):
        valid[r, lp - n:] = 1
        keys[r, 0, lp - n:, 0] = r + 1  # row id in channel 0
    rb.add(kv_cache.PrefilledRows([keys, keys.clone()], [keys.clone(), keys.clone()], valid,
                                  torch.tensor(lengths)), last_tokens=torch.arange(rows))
    return rb


def test_remove_swaps_last_rows_in_and_trims_leading_padding():
    rb = _batch_with(5, [2, 6, 3, 4, 1])
    assert rb.end - rb.start == 6
    order = rb.remove([1, 3])  # the only 6-long row leaves: 2 leading columns become all-padding
    assert order == [0, 4, 2]
    assert rb.size == 3 and rb.end - rb.start == 3
    assert rb.last_tokens.tolist() == [0, 4, 2] and rb.next_pos.tolist() == [2, 1, 3]
    ids = rb.keys(0)[:, 0, :, 0]
    mask = rb.valid_mask()
    assert torch.equal(ids * mask, torch.tensor([[0, 1, 1], [0, 0, 5], [3, 3, 3]]).float())
    assert rb.remove([0, 1, 2]) == [] and rb.size == 0


def test_add_widens_the_live_region_for_longer_prompts():
    rb = _batch_with(2, [2, 1])
    col = rb.reserve_column()
    with torch.inference_mode():  # the buffers are inference tensors, as in the engine's steps
        for i in range(2):
            rb.k[i][:2, :, col] = 9.0
        rb.bias[:2, col] = 0.0
    rb.commit_column()
    keys = torch.full((1, 1, 5, 2), 7.0)
    rb.add(kv_cache.PrefilledRows([keys, keys], [keys, keys], torch.ones(1, 5, dtype=torch.long),
                                  torch.tensor([5])), last_tokens=torch.tensor([0]))
    assert rb.size == 3 and rb.end - rb.start == 5
    mask = rb.valid_mask()
    assert mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1], [1, 1, 1, 1, 1]]
    # the old rows' columns kept their content and alignment: the column written last is last
    assert rb.keys(0)[:2, 0, -1, 0].tolist() == [9.0, 9.0]
