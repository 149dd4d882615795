"""A checkpoint whose config.json disagrees with its weights is refused by ``mrl plan`` and ``mrl train``
before anything starts, in one line naming the key, the tensor, its file and the fix (issue 53 item 8).

The truth for "fits" is transformers itself: every tiny family's checkpoint written by ``save_pretrained``
passes; each broken copy changes one number of config.json (or drops one tensor), as a user's mismatched
download would."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mrl.cli import EXIT_CONFIG, main
from mrl.config import check_config, load_config
from mrl.config.checkpoint_files import safetensors_header, weight_files
from mrl.config.preflight import train_preflight
from mrl.config.weights_fit import weights_fit_problems
from tests.helpers.tiny_models import make_tiny_hf

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "deepseek_v3",
            "glm4_moe", "deepseek_v32", "glm_moe_dsa")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fit")
    return {f: make_tiny_hf(root / f, f) for f in ("qwen2", "qwen3", "qwen3_moe")}


def _shapes(d: Path) -> dict[str, list[int]]:
    return {n: v["shape"] for f in weight_files(d) for n, v in safetensors_header(f).items() if n != "__metadata__"}


def _problems(d: Path, **config_changes) -> list[str]:
    cfg = {**json.loads((d / "config.json").read_text()), **config_changes}
    shapes = _shapes(d)
    return weights_fit_problems(cfg, shapes, {n: d / "model.safetensors" for n in shapes})


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_saved_by_transformers_fits(family: str, tmp_path: Path) -> None:
    assert _problems(make_tiny_hf(tmp_path / family, family)) == []


@pytest.mark.parametrize("moe,wrapped", [(False, True), (True, True), (False, False)],
                         ids=["qwen3_5-vl", "qwen3_5_moe-vl", "qwen3_5-text"])
def test_hybrid_and_vision_language_checkpoints_fit(moe: bool, wrapped: bool, tmp_path: Path) -> None:
    """Qwen3.5: linear-attention layers without self_attn, a gated q_proj (2 x heads x head_dim rows), the decoder under
    model.language_model.* beside a vision tower and text_config in config.json: all read through the decoder view."""
    from tests.helpers.tiny_qwen3_5 import make_tiny_qwen3_5_hf

    d = make_tiny_qwen3_5_hf(tmp_path / "m", moe=moe, wrapped=wrapped)
    cfg = json.loads((d / "config.json").read_text())
    assert _problems(d) == []
    text = cfg.get("text_config", cfg)
    text["num_attention_heads"] = 8  # the full-attention layer's gated q_proj is [2 * 4 * 16, 64]
    problems = weights_fit_problems(cfg, _shapes(d), {})
    prefix = "model.language_model." if wrapped else "model."
    assert any(f"{prefix}layers.2.self_attn.q_proj.weight [128, 64]" in p and "gives [256, 64]" in p
               for p in problems), problems


# (family, config.json change, what the one line must name)
MISMATCHES = [
    ("qwen2", {"hidden_size": 128}, ["model.embed_tokens.weight [300, 64]", "gives [300, 128]"]),
    ("qwen2", {"num_hidden_layers": 6}, ["num_hidden_layers=6", "hold 4 decoder layers"]),
    ("qwen2", {"num_hidden_layers": 2}, ["num_hidden_layers=2", "hold 4 decoder layers"]),
    ("qwen2", {"vocab_size": 500}, ["model.embed_tokens.weight [300, 64]", "gives [500, 64]"]),
    ("qwen2", {"intermediate_size": 256}, ["mlp.gate_proj.weight [128, 64]", "(intermediate_size, hidden_size) gives [256, 64]"]),
    # no head_dim in a qwen2 config.json: the query's width per head is 64 / 8 = 8, so k/v (2 groups) must be 16 rows
    ("qwen2", {"num_attention_heads": 8}, ["self_attn.k_proj.weight [32, 64]", "gives [16, 64]"]),
    ("qwen2", {"num_key_value_heads": 4}, ["self_attn.k_proj.weight [32, 64]", "gives [64, 64]"]),
    ("qwen3", {"num_attention_heads": 8}, ["self_attn.q_proj.weight [64, 64]", "gives [128, 64]"]),
    ("qwen3", {"head_dim": 32}, ["self_attn.q_proj.weight [64, 64]", "gives [128, 64]"]),
    ("qwen3_moe", {"moe_intermediate_size": 96}, ["mlp.experts.0.gate_proj.weight [48, 64]", "gives [96, 64]"]),
    ("qwen3_moe", {"num_local_experts": 8}, ["8 routed experts", "holds 4"]),  # transformers 5 writes this key
]


@pytest.mark.parametrize("family,change,needles", MISMATCHES, ids=[f"{m[0]}-{next(iter(m[1]))}={next(iter(m[1].values()))}"
                                                                 for m in MISMATCHES])
def test_plan_and_train_refuse_a_config_that_does_not_fit(family: str, change: dict, needles: list[str],
                                                          ckpts: dict[str, Path], tmp_path: Path,
                                                          base_overrides: list[str]) -> None:
    d = shutil.copytree(ckpts[family], tmp_path / "m")
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), **change}))
    cfg = load_config(None, [*base_overrides, f"model.path={d}"], check=False)
    errors, _ = check_config(cfg)
    line = next((e for e in errors if "the weights do not fit config.json" in e), None)
    assert line is not None, errors
    assert line.startswith(f"model.path={str(d)!r}: ") and "\n" not in line and "fix:" in line, line
    assert all(n in line for n in needles), line
    assert any("the weights do not fit config.json" in e for e in train_preflight(cfg))


def test_mrl_plan_exits_2_in_one_line(ckpts: dict[str, Path], tmp_path: Path, base_overrides: list[str],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    d = shutil.copytree(ckpts["qwen2"], tmp_path / "m")
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "vocab_size": 500}))
    (tmp_path / "run.yaml").write_text("")
    ov = [o for o in base_overrides if not o.startswith("model.path=")]
    assert main(["plan", str(tmp_path / "run.yaml"), *ov, f"model.path={d}"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "the weights do not fit config.json" in err and "Traceback" not in err, err


def test_untied_config_without_lm_head_is_refused_naming_the_file(ckpts: dict[str, Path]) -> None:
    d = ckpts["qwen2"]  # a tied checkpoint: no lm_head.weight
    assert "lm_head.weight" not in _shapes(d)
    problems = _problems(d, tie_word_embeddings=False)
    assert len(problems) == 1 and "tie_word_embeddings=false" in problems[0] and "lm_head.weight" in problems[0]
    assert _problems(d, tie_word_embeddings=True) == []


def test_expert_count_keys_that_disagree_are_refused(ckpts: dict[str, Path], tmp_path: Path,
                                                     base_overrides: list[str]) -> None:
    d = shutil.copytree(ckpts["qwen3_moe"], tmp_path / "m")  # 4 experts' weights
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_experts": 16, "num_local_experts": 4}))
    errors, _ = check_config(load_config(None, [*base_overrides, f"model.path={d}"], check=False))
    assert any("num_experts=16 and num_local_experts=4" in e and "fix:" in e for e in errors), errors
    (d / "config.json").write_text(json.dumps({**cfg, "num_experts": 4, "num_local_experts": 4}))
    errors, _ = check_config(load_config(None, [*base_overrides, f"model.path={d}"], check=False))
    assert not [e for e in errors if "num_local_experts" in e or "do not fit" in e], errors


def test_tensors_it_cannot_derive_are_left_alone(ckpts: dict[str, Path]) -> None:
    """Vision towers, multi-token-prediction layers and other names outside the family's rules pass."""
    d = ckpts["qwen3"]
    cfg = json.loads((d / "config.json").read_text())
    shapes = {**_shapes(d), "model.visual.blocks.0.attn.qkv.weight": [3, 7], "mtp.layers.0.proj.weight": [5, 5]}
    assert weights_fit_problems(cfg, shapes, {}) == []
    # one multi-token-prediction layer after the last decoder layer (DeepSeek-V3's layout) only when config.json says so
    shapes["model.layers.4.input_layernorm.weight"] = [64]
    assert weights_fit_problems({**cfg, "num_nextn_predict_layers": 1}, shapes, {}) == []
    assert any("hold 5 decoder layers" in p for p in weights_fit_problems(cfg, shapes, {}))
