"""Random [B, T] inputs shared by the oracle tests: prefix response masks (one empty row unless
asked not to), groups of ``n`` samples per uid, log-probs <= 0 with a policy drift."""
from __future__ import annotations

import numpy as np
import torch

B, T, N = 12, 9, 4  # 3 groups of 4 samples, 9 response tokens


def prefix_mask(seed: int, *, empty_row: bool = True, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    if empty_row:
        lengths[5] = 0
    return (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(dtype)


def index() -> np.ndarray:
    return np.repeat(np.arange(B // N), N)


def log_probs(seed: int, *, drift: float = 0.3, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(old_log_prob, log_prob): old in [-3, -0.01], new = old + drift N(0, 1), clamped to <= -1e-3."""
    g = torch.Generator().manual_seed(seed)
    old = -(torch.rand(B, T, generator=g, dtype=torch.float64) * 3 + 0.01)
    new = (old + drift * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    return old.to(dtype), new.to(dtype)


def randn(seed: int, *shape, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
