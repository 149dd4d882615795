"""lora_config.json checks on resume: a LoRA run refuses a full checkpoint and a mismatching adapter set."""
from __future__ import annotations

import pytest

from mrl.config.lora import LoraConfig
from mrl.megatron.checkpoint import CheckpointError
from mrl.megatron.lora_io import check_lora_matches, read_lora_meta, write_lora_meta


def test_resume_checks(tmp_path):
    check_lora_matches(tmp_path, LoraConfig())  # full checkpoint, LoRA off: fine
    with pytest.raises(CheckpointError, match="saved without LoRA but actor.lora.rank=8"):
        check_lora_matches(tmp_path, LoraConfig(rank=8))
    write_lora_meta(tmp_path, LoraConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj"]), "base/")
    assert read_lora_meta(tmp_path) == {"rank": 8, "alpha": 16.0, "dropout": 0.0, "targets": ["q_proj", "v_proj"],
                                        "base_model": "base/"}
    check_lora_matches(tmp_path, LoraConfig(rank=8, alpha=16, target_modules=["v_proj", "q_proj"]))
    for bad in (LoraConfig(), LoraConfig(rank=4, alpha=16, target_modules=["q_proj", "v_proj"]),
                LoraConfig(rank=8, alpha=32, target_modules=["q_proj", "v_proj"]), LoraConfig(rank=8, alpha=16)):
        with pytest.raises(CheckpointError, match="actor.lora.rank=8 actor.lora.alpha=16.0 actor.lora.target_modules"):
            check_lora_matches(tmp_path, bad)


def test_checkpoint_records_the_targets_the_model_has():
    """all-linear names every projection mrl adapts; lora_config.json (and the peft adapter_config.json made from it)
    records those the model has: a Llama keeps the seven names its checkpoints always had (so they resume), a Qwen3.5
    adds its Gated DeltaNet projections, Qwen3-Next its grouped ones."""
    import transformers as tf

    from mrl.families.views import decoder_config
    from mrl.megatron.lora import adapted_targets
    from tests.helpers.tiny_hybrid import hybrid_config

    every = LoraConfig(rank=8).targets
    seven = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    llama = tf.LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=96)
    llama.architectures = ["LlamaForCausalLM"]
    assert adapted_targets(every, llama) == seven
    assert adapted_targets(every, decoder_config(hybrid_config("qwen3_5"))) == seven + (
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    assert adapted_targets(every, hybrid_config("qwen3_next")) == seven + ("in_proj_qkvz", "in_proj_ba", "out_proj")
    assert adapted_targets(("q_proj", "in_proj_qkvz"), llama) == ("q_proj",)
