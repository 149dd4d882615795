"""actor.checkpoint.save_contents with hf_model at TP2 (2 gloo ranks): the actor/huggingface directory
loads with ``AutoModelForCausalLM.from_pretrained`` and gives the trained actor's log-probs; a save
without optimizer is refused by a resume that asks for it (naming the config key) and loads without.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf

pytestmark = [pytest.mark.slow, pytest.mark.multirank, pytest.mark.timeout(300)]


def _rank(rank, world, path, ckpt_dir):
    from mrl.config.actor import ActorConfig
    from mrl.megatron.checkpoint import CheckpointError
    from mrl.workers.actor import ActorWorker
    from tests.workers.batches import portable, ragged_batch

    cfg = ActorConfig(megatron={"tensor_model_parallel_size": 2}, ppo_micro_batch_size_per_gpu=4,
                      optim={"lr": 1e-2})
    actor = ActorWorker(cfg, model_path=path, mini_batch_size_samples=8, seed=1234)
    out = {"lp0": actor.compute_log_prob(ragged_batch(seed=2))[0]}
    actor.update_policy(ragged_batch(seed=1))  # the export must carry trained weights, not model.path's
    out["lp1"] = actor.compute_log_prob(ragged_batch(seed=2))[0]
    actor.save_checkpoint(f"{ckpt_dir}/full", ["model", "optimizer", "extra", "hf_model"])
    actor.save_checkpoint(f"{ckpt_dir}/bare", ["model"])
    try:
        actor.load_checkpoint(f"{ckpt_dir}/bare", ["model", "optimizer", "extra"])
    except CheckpointError as e:
        out["refused"] = str(e)
    actor.load_checkpoint(f"{ckpt_dir}/bare", ["model"])
    out["lp_bare"] = actor.compute_log_prob(ragged_batch(seed=2))[0]
    return portable(out)


def test_hf_model_in_checkpoint_loads_in_transformers_with_the_actors_log_probs(tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.workers.batches import ragged_batch, tensors
    from tests.workers.reference_impl import hf_log_probs

    src = make_tiny_hf(tmp_path / "qwen2", "qwen2")
    res = tensors(run_ranks(_rank, 2, args=(str(src), str(tmp_path / "ck")), timeout_s=280))
    r = res[0]
    hf_dir = tmp_path / "ck" / "full" / "huggingface"
    assert (hf_dir / "model.safetensors").is_file() and (hf_dir / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(str(hf_dir)).vocab_size == AutoTokenizer.from_pretrained(str(src)).vocab_size
    with torch.no_grad():
        lp, _ = hf_log_probs(model, ragged_batch(seed=2))
    torch.testing.assert_close(lp, r["lp1"], rtol=0, atol=1e-5)
    moved = float((r["lp1"] - r["lp0"]).abs().max())
    assert moved > 1e-3, moved  # the update moved the policy, so matching lp1 means the trained weights
    print(f"HF export vs actor: max |d log-prob| {float((lp - r['lp1']).abs().max()):.2e} (update moved {moved:.2e})")
    # model-only save: config + tokenizer in huggingface/ (verl writes them always), no weights, no optimizer
    bare = tmp_path / "ck" / "bare"
    assert (bare / "huggingface" / "config.json").is_file() and not (bare / "huggingface" / "model.safetensors").exists()
    assert json.loads((bare / "mrl_checkpoint.json").read_text())["has_optimizer"] is False
    assert "actor.checkpoint.load_contents" in r["refused"] and "save_contents had no 'optimizer'" in r["refused"]
    torch.testing.assert_close(r["lp_bare"], r["lp1"], rtol=0, atol=0)
