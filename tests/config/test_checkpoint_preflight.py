"""Preflight of the checkpoints a run reads: every broken model/RM/tokenizer path is refused by
``mrl plan`` (or, for "not here yet", by ``mrl train`` before Ray) with the key, the file and the fix,
exit 2 and no traceback. Each directory below is a copy of one real tiny checkpoint, then broken."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mrl.cli import EXIT_CONFIG, main
from mrl.config import check_config, load_config
from mrl.config.checkpoint_files import safetensors_header, supported_architectures
from mrl.config.preflight import train_preflight
from tests.config.conftest import TINY_QWEN2
from tests.helpers.tiny_models import make_tiny_hf


@pytest.fixture(scope="module")
def real_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf(tmp_path_factory.mktemp("real") / "m", num_hidden_layers=4)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _truncate(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garbage_header(d: Path) -> None:
    (d / "model.safetensors").write_bytes(b"\xff" * 64)


def _bert(d: Path) -> None:
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, "architectures": ["BertForMaskedLM"]}))


def _no_tokenizer(d: Path) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).unlink(missing_ok=True)


def _bad_tokenizer_json(d: Path) -> None:
    (d / "tokenizer.json").write_text("{not json")


def _missing_shard(d: Path) -> None:
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))


def _bin_only(d: Path) -> None:
    (d / "model.safetensors").rename(d / "pytorch_model.bin")


def _bad_config(d: Path) -> None:
    (d / "config.json").write_text("{")


def _fp8(d: Path) -> None:
    c = json.loads((d / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps({**c, "quantization_config": quant}))


# (case, how the copy is broken, substrings of one error)
BROKEN = [
    ("truncated_weights", _truncate, ["model.path", "model.safetensors is truncated", "fix:"]),
    ("garbage_header", _garbage_header, ["model.path", "header length", "fix:"]),
    ("unsupported_architecture", _bert, ["model.path", "BertForMaskedLM", "Qwen2ForCausalLM"]),
    ("no_tokenizer", _no_tokenizer, ["model.path", "no tokenizer files", "fix:"]),
    ("tokenizer_json_broken", _bad_tokenizer_json, ["tokenizer.json is not valid JSON", "fix:"]),
    ("index_lists_missing_shard", _missing_shard, ["model.safetensors.index.json", "model-00002-of-00002", "download"]),
    ("bin_only", _bin_only, ["model.path", ".bin", "safe_serialization=True"]),
    ("config_not_json", _bad_config, ["model.path", "config.json", "fix:"]),
    ("fp8_quantized", _fp8, ["model.path", "quant_method=fp8", "fix: a bf16 copy"]),
]


def _errors(overrides: list[str]) -> tuple[list[str], list[str]]:
    return check_config(load_config(None, overrides, check=False))


@pytest.mark.parametrize("case,breaker,needles", BROKEN, ids=[b[0] for b in BROKEN])
def test_plan_refuses_a_broken_checkpoint(case, breaker, needles, real_model: Path, tmp_path: Path,
                                          base_overrides: list[str]) -> None:
    d = _copy(real_model, tmp_path / case)
    breaker(d)
    errors, _ = _errors([*base_overrides, f"model.path={d}"])
    assert any(all(n in e for n in needles) for e in errors), errors


def test_the_real_checkpoint_passes_plan_and_train_preflight(real_model: Path, base_overrides: list[str]) -> None:
    cfg = load_config(None, [*base_overrides, f"model.path={real_model}"], check=False)
    errors, _ = check_config(cfg)
    assert not [e for e in errors if "model.path" in e], errors
    assert train_preflight(cfg) == []


@pytest.mark.parametrize("kind", ["file", "non_model_dir"])
def test_plan_refuses_a_path_that_is_not_a_checkpoint(kind: str, tmp_path: Path, base_overrides: list[str]) -> None:
    p = tmp_path / kind
    if kind == "file":
        p.write_text("hello")
    else:
        p.mkdir()
        if kind == "non_model_dir":
            (p / "notes.txt").write_text("x")
    errors, notes = _errors([*base_overrides, f"model.path={p}"])
    assert any("model.path" in e and ("is a file" if kind == "file" else "without config.json") in e for e in errors), errors
    assert not any("checks" in n and "skipped" in n for n in notes), notes


def test_config_only_dir_is_a_plan_note_and_a_train_error(tiny_model: Path, base_overrides: list[str]) -> None:
    """A plan may be made with only config.json downloaded; mrl train refuses it before Ray."""
    cfg = load_config(None, base_overrides, check=False)
    errors, notes = check_config(cfg)
    assert not errors and any("no weights here (yet)" in n for n in notes), (errors, notes)
    assert any(f"model.path={str(tiny_model)!r} holds no weights" in e for e in train_preflight(cfg))


def test_tokenizer_path_is_read_or_refused(real_model: Path, tmp_path: Path, base_overrides: list[str]) -> None:
    errors, _ = _errors([*base_overrides, f"model.path={real_model}", "model.tokenizer_path=/nonexistent/tok"])
    assert any("model.tokenizer_path='/nonexistent/tok'" in e and "fix:" in e for e in errors), errors
    errors, _ = _errors([*base_overrides, f"model.path={real_model}", f"model.tokenizer_path={real_model}/."])
    assert not [e for e in errors if "tokenizer_path" in e], errors


def test_a_tokenizer_that_parses_but_does_not_load_is_a_train_error(real_model: Path, tmp_path: Path,
                                                                     base_overrides: list[str]) -> None:
    d = _copy(real_model, tmp_path / "m")
    (d / "tokenizer.json").write_text("{}")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "NoSuchTokenizer"}))
    cfg = load_config(None, [*base_overrides, f"model.path={d}"], check=False)
    errors = train_preflight(cfg)
    assert any("model.path=" in e and "tokenizer does not load" in e for e in errors), errors


def test_reward_model_paths(real_model: Path, tmp_path: Path, base_overrides: list[str]) -> None:
    rm_on = ["reward_model.enable=true", "reward_model.combine=rm"]
    notes_only = tmp_path / "nope"
    cfg = load_config(None, [*base_overrides, f"model.path={real_model}", *rm_on, f"reward_model.model.path={notes_only}"],
                      check=False)
    errors, notes = check_config(cfg)
    assert not [e for e in errors if "reward_model.model.path" in e] and any("does not exist here" in n for n in notes)
    assert any("reward_model.model.path=" in e and "does not exist" in e for e in train_preflight(cfg))
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "README.md").write_text("not a model")
    errors, _ = _errors([*base_overrides, f"model.path={real_model}", *rm_on, f"reward_model.model.path={junk}"])
    assert any("reward_model.model.path=" in e and "without config.json" in e for e in errors), errors


def test_safetensors_header_bounds(tmp_path: Path) -> None:
    f = tmp_path / "x.safetensors"
    f.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="too short"):
        safetensors_header(f)
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    f.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 15)
    with pytest.raises(ValueError, match="truncated"):
        safetensors_header(f)
    f.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)
    assert safetensors_header(f)["w"]["shape"] == [4]


def test_supported_architectures_are_the_providers_and_read_without_torch() -> None:
    from mrl.megatron.provider import SUPPORTED_ARCHITECTURES

    assert supported_architectures() == SUPPORTED_ARCHITECTURES
    # read without importing the provider (torch): what keeps `mrl plan` light
    probe = ("import sys; from mrl.config.checkpoint_files import supported_architectures as s; n = len(s()); "
             "print(n, sorted(m for m in ('torch', 'megatron', 'mrl.megatron.provider') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.split() == [str(len(SUPPORTED_ARCHITECTURES)), "[]"], out.stdout + out.stderr


@pytest.mark.parametrize("broken", ["truncated", "config_only"])
def test_mrl_train_exits_2_without_traceback(broken: str, real_model: Path, tiny_model: Path, tmp_path: Path,
                                            base_overrides: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A truncated file is refused at the plan stage, a config.json-only directory by train's preflight."""
    d = tiny_model
    if broken == "truncated":
        d = _copy(real_model, tmp_path / "m")
        _truncate(d)
    (tmp_path / "run.yaml").write_text("")
    ov = [o for o in base_overrides if not o.startswith("model.path=")]
    assert main(["train", str(tmp_path / "run.yaml"), *ov, f"model.path={d}"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert ("model.safetensors is truncated" if broken == "truncated" else "holds no weights") in err, err
    assert "Traceback" not in err


def test_tiny_config_is_qwen2() -> None:
    assert TINY_QWEN2["architectures"][0] in supported_architectures()


def test_a_kimi_k2_style_model_type_is_refused_with_the_fix(real_model: Path, tmp_path: Path,
                                                            base_overrides: list[str]) -> None:
    """Kimi-K2 names DeepSeek-V3's architecture with model_type kimi_k2 (remote code); transformers reads a config
    by model_type, so mrl asks for the family's."""
    d = _copy(real_model, tmp_path / "kimi")
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, "model_type": "kimi_k2"}))
    errors, _ = _errors([*base_overrides, f"model.path={d}"])
    assert any("model_type='kimi_k2'" in e and '"model_type": "qwen2"' in e for e in errors), errors
