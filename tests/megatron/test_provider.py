"""Config-level checks of mrl.megatron.provider (single process, no Megatron groups needed)."""
from __future__ import annotations

import json

import pytest

from mrl.megatron.provider import (
    SUPPORTED_ARCHITECTURES,
    _check_supported,
    _rope_params,
    load_hf_config,
    model_family,
    padded_vocab_size,
)
from tests.helpers.tiny_models import hf_config, make_tiny_hf


def test_unsupported_architecture_lists_supported(tmp_path):
    cfg = hf_config("llama")
    cfg.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError) as err:
        model_family(cfg)
    msg = str(err.value)
    assert "GPT2LMHeadModel" in msg and "config.json" in msg
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in msg


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_family_from_saved_config(tmp_path, family):
    path = make_tiny_hf(tmp_path / family, family)
    assert json.loads((path / "config.json").read_text())["architectures"]
    assert model_family(load_hf_config(path)) == family


def test_missing_config_names_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_config(tmp_path)


@pytest.mark.parametrize(
    "vocab,tp,div,want",
    [(300, 1, 128, 384), (300, 2, 128, 512), (250, 2, 4, 256), (256, 2, 128, 256), (151936, 4, 128, 152064)],
)
def test_padded_vocab_size(vocab, tp, div, want):
    got = padded_vocab_size(vocab, tp, div)
    assert got == want and got % (div * tp) == 0 and got >= vocab


def test_rope_default_and_llama3():
    assert _rope_params(hf_config("llama", rope_theta=500000.0)) == (500000.0, False, 1.0)
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
    cfg = hf_config("llama", max_position_embeddings=16384, rope_scaling=scaling)
    assert _rope_params(cfg) == (10000.0, True, 32.0)


def test_rope_unsupported_variants_are_errors():
    bad = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    with pytest.raises(ValueError, match="low_freq_factor"):
        _rope_params(hf_config("llama", max_position_embeddings=16384, rope_scaling=bad))
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        _rope_params(hf_config("llama", rope_scaling={"rope_type": "dynamic", "factor": 4.0}))
    # YaRN is read for every family (Megatron's YaRN embedding; gpt-oss's parity test runs it)
    from mrl.megatron.provider import yarn_params

    yarn = hf_config("llama", rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    assert _rope_params(yarn) == (10000.0, False, 1.0) and yarn_params(yarn)["yarn_rotary_scaling_factor"] == 4.0


def test_unsupported_features_are_errors():
    with pytest.raises(ValueError, match="use_sliding_window"):
        _check_supported(hf_config("qwen2", use_sliding_window=True), "qwen2")  # windows on some layers only
    with pytest.raises(ValueError, match="hidden_act"):
        _check_supported(hf_config("llama", hidden_act="gelu"), "llama")
    _check_supported(hf_config("qwen2"), "qwen2")  # qkv bias is native to qwen2
