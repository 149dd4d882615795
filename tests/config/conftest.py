"""Fixtures: a valid base config on a tiny local HF model config (no downloads).

Config checks read only ``config.json`` (plain json), so the fixture writes just that file with
the numbers of ``tests.helpers.tiny_models`` (qwen2 family); test_plan_report.py checks the parameter
count derived from it against the real transformers model built from the same numbers.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
}


def write_hf_config(path: Path, cfg: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """config.json of the tiny qwen2: 4 heads, 2 KV heads, 4 layers, 256 positions, vocab 300."""
    return write_hf_config(tmp_path_factory.mktemp("tiny") / "qwen2", TINY_QWEN2)


@pytest.fixture(scope="session")
def train_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("data") / "train.jsonl"
    f.write_text('{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}\n' * 64)  # >= any batch the tests plan (mrl plan counts rows)
    return f


@pytest.fixture()
def base_overrides(tiny_model: Path, train_file: Path) -> list[str]:
    """A valid CPU config: 4 ranks, actor DP 4, GRPO n=4, 8 prompts/step, mini-batch 4 prompts, micro 2."""
    return [
        "cluster.device=cpu",
        "cluster.n_gpus_per_node=4",
        f"model.path={tiny_model}",
        "model.dtype=float32",
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_gpu=2",
        "actor.use_kl_loss=true",
        "rollout.n=4",
        "rollout.max_response_length=32",
        f"data.train_files=[{train_file}]",
        "data.max_prompt_length=64",
        "data.train_batch_size=8",
    ]
