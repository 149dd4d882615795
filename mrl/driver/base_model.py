"""Which base model a run started from, recorded in every checkpoint's trainer_state.json and compared
on resume before Ray starts: a resume against another model is refused with what differs (issue 33:
same shapes with other weights resumed silently, the reference then came from the new model.path while
the actor came from the checkpoint; other shapes failed in every rank with a traceback).

The fingerprint reads config.json and, of every safetensors file, its size and 16 evenly spaced 64 KiB
samples (CRC32): a second for a 70B checkpoint, and different weights differ in every sample."""
from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

from mrl.config.checkpoint_files import weight_files

_SAMPLES, _SAMPLE_BYTES = 16, 1 << 16
SHAPE_KEYS = ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size", "tie_word_embeddings")


def fingerprint(model_path: str) -> str | None:
    """A short hex digest of ``model_path``'s config.json and weights; None when they cannot be read."""
    p = Path(model_path)
    try:
        crc = zlib.crc32((p / "config.json").read_bytes())
        for f in weight_files(p) or []:
            size = f.stat().st_size
            crc = zlib.crc32(f"{f.name}:{size}".encode(), crc)
            with f.open("rb") as fh:
                for k in range(_SAMPLES):
                    fh.seek(max(0, (size - _SAMPLE_BYTES) * k // (_SAMPLES - 1)))
                    crc = zlib.crc32(fh.read(_SAMPLE_BYTES), crc)
    except (OSError, ValueError):
        return None
    return f"{crc:08x}"


def record(model_path: str) -> dict[str, Any]:
    """What trainer_state.json keeps of the base model."""
    return {"path": str(model_path), "fingerprint": fingerprint(model_path)}


def mismatch(model_path: str, saved_hf_config: dict | None, saved: dict | None) -> str | None:
    """Why ``model_path`` is not the model the checkpoint was trained from (None: it is, or unknown)."""
    try:
        now = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        now = None
    if isinstance(now, dict) and isinstance(saved_hf_config, dict):
        diff = [f"{k}: checkpoint {saved_hf_config.get(k)!r}, model.path {now.get(k)!r}" for k in SHAPE_KEYS
                if k in saved_hf_config and saved_hf_config.get(k) != now.get(k)]
        if diff:
            return "the checkpoint's model has another shape (" + "; ".join(diff) + ")"
    if saved and saved.get("fingerprint"):
        got = fingerprint(model_path)
        if got is not None and got != saved["fingerprint"]:
            return (f"model.path holds other weights than the run started from ({saved.get('path')!r}, fingerprint "
                    f"{saved['fingerprint']}; now {got}): the actor would resume from the checkpoint while the "
                    "reference (and KL) came from these weights")
    return None
