"""The model inside Megatron's wrappers (DDP, Float16Module), one rule for every caller."""
from __future__ import annotations

import torch


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """Strip ``.module`` wrappers down to the ``GPTModel`` (the first module with a ``decoder``)."""
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk
