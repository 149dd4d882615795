"""Preflight of the checkpoints a run reads (model.path, model.tokenizer_path, critic.model_path,
reward_model.model.path), with the standard library only: ``mrl plan`` answers in well under a second.

A model directory is opened just enough to know it will load: config.json parses and names a supported
architecture, the safetensors index parses and lists shards that exist, every shard's header parses and
its tensors end inside the file (a truncated download fails here, not as ``SafetensorError: invalid
header length`` in every rank), and the directory holds tokenizer files. ``mrl train`` adds the real
tokenizer load (:func:`mrl.config.preflight.train_preflight`). The tensors' shapes are checked against
config.json by :mod:`mrl.config.weights_fit`.

Plan and train differ in one way: a path that does not exist, or a directory holding only config.json
(a plan made before the download), is a note for ``mrl plan`` and an error for ``mrl train``.
Every error names the key, the file and the fix.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from mrl.config.weights_fit import experts_conflict, weights_fit_errors

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
# what AutoTokenizer can build a tokenizer from (fast json, sentencepiece, BPE vocab + merges, tiktoken)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer.tiktoken", "vocab.txt")


def supported_architectures() -> dict[str, str]:
    """The architectures mrl trains (architecture -> family), from the torch-free family registry the provider
    builds from (:mod:`mrl.families`): ``mrl plan`` reads it without importing the model code (docs/performance.md)."""
    from mrl.families import SUPPORTED_ARCHITECTURES

    return SUPPORTED_ARCHITECTURES


def untrainable_vision_language(cfg: dict[str, Any]) -> bool:
    """A vision-language checkpoint (``vision_config`` in config.json) none of whose architectures mrl trains (the
    families with a vision tower, :mod:`mrl.families`; docs/vision.md)."""
    archs = cfg.get("architectures") or []
    supported = supported_architectures()
    return "vision_config" in cfg and not (isinstance(archs, list) and any(a in supported for a in archs))


def vision_family(cfg: dict[str, Any]) -> Any | None:
    """The family of a vision-language config.json whose family builds and runs its vision tower in the actor (pictures
    in the prompts train); None for a text model and for a release whose tower mrl carries without running it
    (Qwen3.5-MoE's: it trains on text only)."""
    from mrl.families import FAMILIES

    if not isinstance(cfg, dict) or "vision_config" not in cfg:
        return None
    supported = supported_architectures()
    for arch in cfg.get("architectures") or []:
        fam = FAMILIES[supported[arch]] if isinstance(arch, str) and arch in supported else None
        if fam is not None and fam.vision is not None:
            return fam
    return None


def trains_pictures(cfg: dict[str, Any]) -> bool:
    """:func:`vision_family` is not None."""
    return vision_family(cfg) is not None


def _vision_refusal() -> str:
    from mrl.families import FAMILIES

    # a vision family's text-only architecture (Qwen3_5ForCausalLM) builds no tower: not named here
    built = sorted(a for f in FAMILIES.values() if f.vision is not None for a in f.architectures
                   if not a.endswith("ForCausalLM"))
    return (f"is a vision-language model whose architecture the Megatron actor does not build (it builds "
            f"{', '.join(built)}: docs/vision.md); fix: one of those, or a text-only checkpoint")


VISION_REFUSAL = _vision_refusal()


def vision_language_refusal(key: str, path: str | None) -> str | None:
    """The one line refusing to train the vision-language checkpoint at ``path`` (None: not one). ``mrl plan`` /
    ``mrl train`` print it after the plan and the prompt files' pictures, which are checked in full."""
    try:
        cfg = json.loads((Path(path or "") / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict) or not untrainable_vision_language(cfg):
        return None
    archs = cfg.get("architectures") or [cfg.get("model_type")]
    return f"{key}={path!r} ({', '.join(map(str, archs))}) {VISION_REFUSAL}"


def safetensors_header(file: Path) -> dict[str, Any]:
    """The parsed header of one safetensors file; ValueError (naming the file) when it is not one or is
    truncated: the 8-byte length, the JSON header and every tensor's ``data_offsets`` must fit the file."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{file} is {size} bytes, too short for a safetensors file (truncated download?)")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{file}: its header length field says {n} bytes but the file has {size} "
                             "(truncated, or not a safetensors file)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{file}: the safetensors header is not JSON ({e}); the file is corrupt") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: the safetensors header is not a JSON object; the file is corrupt")  # noqa: TRY004 - one error type for every corrupt file
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise ValueError(f"{file}: tensor {name!r} has no valid data_offsets in the header; the file is corrupt")
        end = max(end, offsets[1])
    if 8 + n + end > size:
        raise ValueError(f"{file} is truncated: its tensors end at byte {8 + n + end} but the file has {size} bytes "
                         "(an interrupted download or copy)")
    return header


def weight_files(d: Path) -> list[Path] | None:
    """The shard files of ``d`` (from the index, or the single file); None when there are none."""
    index = d / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
            raise ValueError(f"{index} is not a JSON object with a 'weight_map' ({e}); re-save the checkpoint") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map' object; re-save the checkpoint")
        shards = sorted({str(s) for s in weight_map.values()})
        missing = [s for s in shards if not (d / s).is_file()]
        if missing:
            raise ValueError(f"{index} lists {len(missing)} shard(s) that are not in {d}: {', '.join(missing[:5])}; "
                             "finish the download")
        return [d / s for s in shards]
    if (d / SINGLE_NAME).is_file():
        return [d / SINGLE_NAME]
    return None


def _tokenizer_problem(d: Path) -> str | None:
    if not any((d / f).is_file() for f in _TOKENIZER_FILES):
        return (f"{d} holds no tokenizer files ({', '.join(_TOKENIZER_FILES)}; e.g. merges.txt alone is not one)")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        f = d / name
        if f.is_file():
            try:
                json.loads(f.read_bytes())
            except (UnicodeDecodeError, ValueError) as e:
                return f"{f} is not valid JSON ({type(e).__name__}: {str(e)[:120]})"
    return None


def model_dir_problems(key: str, path: str, *, strict: bool, architectures: str = "causal_lm",
                       need_tokenizer: bool = True) -> tuple[list[str], list[str]]:
    """(errors, notes) for the HF checkpoint directory ``path`` of config key ``key``.

    ``architectures``: ``causal_lm`` (one of mrl's supported families), ``seq_cls`` (a reward model:
    reward_model.py checks its class) or ``any``. ``strict`` (mrl train) turns "not here yet" into errors.
    """
    p = Path(path)
    fix = f"fix: point {key} at a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files)"
    if not p.exists():
        if strict:
            return [f"{key}={path!r} does not exist on this host; {fix}"], []
        return [], []  # mrl plan notes missing inputs elsewhere (validate.missing_inputs / the RM's note)
    if not p.is_dir():
        return [f"{key}={path!r} is a file, not a checkpoint directory; {fix}"], []
    conf = p / "config.json"
    if not conf.is_file():
        if not strict and not any(p.iterdir()):
            return [], [f"{key}={path!r} is an empty directory (a download to come?); mrl train needs a checkpoint there"]
        return [f"{key}={path!r} is a directory without config.json, not a model checkpoint; {fix}"], []
    errors: list[str] = []
    try:
        cfg = json.loads(conf.read_bytes())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return [f"{key}: {conf} is not valid JSON ({type(e).__name__}: {str(e)[:120]}); {fix}"], []
    if not isinstance(cfg, dict):
        return [f"{key}: {conf} is not a JSON object; {fix}"], []
    if architectures == "causal_lm":
        archs = cfg.get("architectures") or []
        supported = supported_architectures()
        # as provider.model_family: a config written in code has no architectures, only model_type
        by_type = not archs and cfg.get("model_type") in supported.values()
        if untrainable_vision_language(cfg):
            if key != "model.path":  # the policy's: vision_language_refusal, after the plan shows its data
                errors.append(f"{key}={path!r} ({', '.join(map(str, archs)) or cfg.get('model_type')}) {VISION_REFUSAL}")
        elif not by_type and (not isinstance(archs, list) or not any(a in supported for a in archs)):
            errors.append(f"{key}={path!r}: config.json names architectures {archs}, which mrl cannot train; "
                          f"fix: a checkpoint of one of {', '.join(sorted(supported))}")
        else:
            family = next((supported[a] for a in archs if a in supported), None) if isinstance(archs, list) else None
            if family is not None and cfg.get("model_type") != family:
                # transformers picks the config class by model_type (Kimi-K2 ships model_type kimi_k2 with
                # remote code for DeepSeek-V3's architecture); mrl loads configs without remote code
                errors.append(f"{key}={path!r}: config.json model_type={cfg.get('model_type')!r} with architectures "
                              f"{archs}: mrl reads it as transformers' {family!r} config; fix: set \"model_type\": "
                              f"\"{family}\" in {conf} (same architecture)")
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "mxfp4":
        errors.append(f"{key}={path!r}: config.json quantization_config.quant_method='mxfp4' (gpt-oss as "
                      "published): mrl trains unquantised weights; fix: a bf16 checkpoint, e.g. dequantised by "
                      "transformers: from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True), "
                      "dtype=torch.bfloat16).save_pretrained(out)")
    elif quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        # mrl reads each tensor as the model's weight: block-scaled fp8 (DeepSeek-V3, Kimi-K2) would load unscaled
        errors.append(f"{key}={path!r}: config.json has a quantization_config (quant_method={method}); mrl trains "
                      "from bf16/fp32 weights and would read quantized tensors without their scales; fix: a bf16 copy "
                      "of the checkpoint (DeepSeek-V3/Kimi-K2: dequantise with the model's fp8_cast_bf16.py, then "
                      "remove quantization_config from config.json)")
    conflict = experts_conflict(cfg)
    if conflict:
        errors.append(f"{key}={path!r}: {conf}: {conflict}")
    try:
        files = weight_files(p)
        headers = {f: safetensors_header(f) for f in files or ()}
    except (OSError, ValueError) as e:
        errors.append(f"{key}: {e}; fix: re-download or re-save the checkpoint at {path!r}")
        files, headers = [], {}
    if headers and not conflict:
        # the shapes config.json gives each tensor against the headers' (the model build would fail in every rank)
        errors += weights_fit_errors(f"{key}={path!r}", path, cfg, headers, lm_head=architectures == "causal_lm")
    if files is None:
        if (p / "pytorch_model.bin").is_file() or any(p.glob("pytorch_model-*.bin")):
            errors.append(f"{key}={path!r} holds only .bin weights, which mrl does not read (they would need "
                          "unpickling); fix: re-save with safe_serialization=True (model.safetensors)")
        elif strict:
            errors.append(f"{key}={path!r} holds no weights ({SINGLE_NAME} or {INDEX_NAME}); {fix}")
        else:
            note = (f"{key}={path!r} holds config.json but no weights here (yet): weights and tokenizer are not "
                    "checked; mrl train needs them")
            return errors, [note]
    if need_tokenizer:
        problem = _tokenizer_problem(p)
        if problem:
            errors.append(f"{key}: {problem}; fix: copy the tokenizer files of the checkpoint into {path!r}")
    return errors, []
