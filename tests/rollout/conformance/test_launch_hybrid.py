"""Hybrid (Gated DeltaNet) checkpoints through SGLang 0.5.23's own code: it recognises all five architectures (and the text-only MoE form) as
hybrid-state models (no flag needed for its state pool), and our command pins the SSM-state dtype, as its
argument parser reads it."""
from __future__ import annotations

import argparse
import json

from mrl.rollout.sglang_launcher import (
    HYBRID_SSM_DTYPE,
    SGLangLaunchSpec,
    build_sglang_command,
)
from tests.helpers.sglang_real import require
from tests.helpers.tiny_hybrid import KINDS, hybrid_config

ARCHS = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_text": "Qwen3_5ForCausalLM",
         "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
         "qwen3_next": "Qwen3NextForCausalLM"}


def _parser():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def test_sglang_detects_the_hybrid_architectures_itself():
    require()
    from sglang.srt.arg_groups.overrides import _MAMBA_RADIX_CACHE_ARCHS

    assert set(ARCHS.values()) <= _MAMBA_RADIX_CACHE_ARCHS


def test_hybrid_checkpoints_get_an_fp32_ssm_state(tmp_path):
    require()
    parser = _parser()
    for kind in KINDS:
        cfg = hybrid_config(kind).to_dict()
        cfg["architectures"] = [ARCHS[kind]]
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "config.json").write_text(json.dumps(cfg))
        cmd = build_sglang_command(SGLangLaunchSpec(model_path=str(tmp_path / kind), port=1), "python")
        assert parser.parse_args(cmd[3:]).mamba_ssm_dtype == HYBRID_SSM_DTYPE == "float32", kind
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    for path in (tmp_path / "dense", "/no/such/model"):
        cmd = build_sglang_command(SGLangLaunchSpec(model_path=str(path), port=1), "python")
        assert parser.parse_args(cmd[3:]).mamba_ssm_dtype is None  # SGLang's default (config, then float32)
    # a user's own flag comes later and wins
    cmd = build_sglang_command(SGLangLaunchSpec(model_path=str(tmp_path / "qwen3_5"), port=1,
                                                extra_args=["--mamba-ssm-dtype", "bfloat16"]), "python")
    assert parser.parse_args(cmd[3:]).mamba_ssm_dtype == "bfloat16"
