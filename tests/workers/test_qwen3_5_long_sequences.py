"""The Qwen3.5 shape on long sequences (tests/workers/test_long_sequences.py's measurement, same rank body): one
update on an 8k-token packed row grows peak memory linearly from 2k, not quadratically — the Gated DeltaNet layer
keeps no KV cache and no s × s scores (its chunked delta rule holds C × C blocks per 64-token chunk and one d_k × d_v
state), and the gated attention layer runs the sdpa backend's flash path. Tiny text-only Qwen3.5: 2 layers (one
Gated DeltaNet, one gated attention), hidden 64; fp32.

Bounds: the growth from 4k to 8k over the growth from 2k to 4k (a fixed part of the update cancels) is 2.0 for
memory linear in the tokens (8448 − 4352) / (4352 − 2304) and 3.8 for quadratic; asserted < ``MAX_INCREMENT_RATIO``
= 3.0. And delta(8k) stays below the 4 value heads' fp32 8448 × 8448 score matrices (1.1 GiB) that a quadratic
token mixer would hold. The chunked delta rule's C × C blocks cost O(L · C) per head — linear, but a constant 64 per
token: at this tiny width the 8k update grows by ~400 MiB, more than the dense model's (docs/megatron.md). The
packed row's log-probs equal each sample's alone (the state restarts at the packed boundary)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_qwen3_5 import make_tiny_qwen3_5_hf
from tests.workers._long_seq_rank import SHORT, measure

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LENGTHS = (2048, 4096, 8192)
MAX_INCREMENT_RATIO = 3.0
VALUE_HEADS = 4  # tests/helpers/tiny_qwen3_5.py's linear_num_value_heads
SCORE_MIB = VALUE_HEADS * (LENGTHS[-1] + SHORT) ** 2 * 4 / 2**20
LP_TOL = 1e-5  # packed vs alone: the same per-sequence chunks, in another batch shape


def test_qwen3_5_packed_update_memory_grows_linearly_to_8k_tokens(tmp_path) -> None:
    path = make_tiny_qwen3_5_hf(tmp_path / "q35", wrapped=False, num_hidden_layers=2,
                                layer_types=["linear_attention", "full_attention"], max_position_embeddings=LENGTHS[-1])
    r = run_ranks(measure, 1, args=(str(path), "sdpa", True, list(LENGTHS), True), timeout_s=280)[0]
    base = r["baseline"]
    delta = {n: r["peaks"][n] - base for n in LENGTHS}
    small, mid, big = LENGTHS
    ratio = (delta[big] - delta[mid]) / (delta[mid] - delta[small])
    figures = (f"qwen3.5 sdpa + packing: baseline {base:.1f} MiB; peak growth "
               + ", ".join(f"{delta[n]:.1f} MiB at {n}+{SHORT} tokens ({r['seconds'][n]:.2f} s)" for n in LENGTHS)
               + f"; increment ratio {ratio:.2f} (linear 2.0, quadratic 3.8, bound {MAX_INCREMENT_RATIO})")
    print(figures)
    for n in LENGTHS:
        m = r["metrics"][n]
        assert math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0, (n, m)
    assert 0 < delta[small] < delta[mid] < delta[big] and ratio < MAX_INCREMENT_RATIO, figures
    assert delta[big] < SCORE_MIB, figures
    mask = r["resp_mask"].astype(bool)
    diff = float(np.abs(r["lp_packed"] - r["lp_alone"])[mask].max())
    print(f"log-probs at {big}+{SHORT} tokens: packed vs alone max |diff| {diff:.2e}")
    assert diff <= LP_TOL
