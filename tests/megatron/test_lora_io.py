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
