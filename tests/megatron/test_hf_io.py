"""mrl.megatron.hf_io: lazy reading by name and sharded writing that transformers loads."""
from __future__ import annotations

import json

import pytest
import torch

from mrl.megatron.hf_io import (
    INDEX_NAME,
    HFCheckpointReader,
    copy_hf_side_files,
    write_hf_checkpoint,
)
from tests.helpers.tiny_models import make_tiny_hf


def test_sharded_write_then_transformers_loads(tmp_path):
    import transformers as tf

    src = make_tiny_hf(tmp_path / "src", "qwen2")
    reader = HFCheckpointReader(src)
    out = tmp_path / "out"
    files = write_hf_checkpoint(out, ((n, reader.get(n)) for n in reader.names()), max_shard_bytes=32 * 1024)
    assert INDEX_NAME in files and len(files) > 2
    index = json.loads((out / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(reader.names())
    (src / "preprocessor_config.json").write_text("{}")  # a vision-language checkpoint's image processor
    copied = copy_hf_side_files(src, out)
    assert "config.json" in copied and "tokenizer.json" in copied and "preprocessor_config.json" in copied
    back = HFCheckpointReader(out)
    for n in reader.names():
        assert torch.equal(back.get(n), reader.get(n)), n
    a = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    b = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.arange(10)[None]
    assert torch.equal(a(ids).logits, b(ids).logits)


def test_single_shard_and_dtype(tmp_path):
    files = write_hf_checkpoint(tmp_path, [("w", torch.ones(2, 2))], dtype=torch.bfloat16)
    assert files == ["model.safetensors"]
    assert HFCheckpointReader(tmp_path).get("w").dtype == torch.bfloat16


def test_missing_tensor_names_it(tmp_path):
    write_hf_checkpoint(tmp_path, [("a", torch.zeros(1))])
    with pytest.raises(KeyError, match="'b' is missing"):
        HFCheckpointReader(tmp_path).get("b")


def test_no_weights_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        HFCheckpointReader(tmp_path)


def test_duplicate_name_is_error(tmp_path):
    with pytest.raises(ValueError, match="twice"):
        write_hf_checkpoint(tmp_path, [("a", torch.zeros(1)), ("a", torch.ones(1))])
