"""The parameter dtypes mrl runs in, under every name they go by: Hugging Face / config names
(``bfloat16``), Megatron / ``mrl-ckpt`` short names (``bf16``), ``torch.dtype`` and bytes per element.
One table, so the engine, the checkpoint tools and the memory estimate cannot disagree."""
from __future__ import annotations

from typing import Any

# config / HF name -> (short name, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {"float32": ("fp32", 4), "bfloat16": ("bf16", 2), "float16": ("fp16", 2)}
SHORT_TO_NAME = {short: name for name, (short, _) in DTYPES.items()}


def canonical(name: str) -> str:
    """``bf16`` / ``torch.bfloat16`` / ``bfloat16`` -> ``bfloat16``; ValueError naming the choices."""
    key = str(name).removeprefix("torch.")
    key = SHORT_TO_NAME.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use one of {sorted(DTYPES)} (or {sorted(SHORT_TO_NAME)})")
    return key


def short_name(name: str) -> str:
    return DTYPES[canonical(name)][0]


def itemsize(name: str) -> int:
    return DTYPES[canonical(name)][1]


def torch_dtype(name: str) -> Any:
    """The ``torch.dtype`` of ``name`` (torch imported here: the config layer uses the names only)."""
    import torch

    return getattr(torch, canonical(name))
