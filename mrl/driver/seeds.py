"""Per-sample sampling seeds: what makes a run reproducible and a resumed run equal the uninterrupted one.

Engines seeded once at start draw differently as soon as requests interleave differently (or an
engine restarts, or the run resumes). Instead every sample carries SGLang's ``sampling_seed``:

    seed(s) = blake2b(run seed, purpose, step, epoch, dataset row, sample index) mod 2^63

a pure function of what the checkpointed trainer state determines (``trainer.seed``, the global
step, the sampler's epoch and the prompt's row, the sample's index within its group), so the same
sample gets the same draws in any process, on any engine, in any batch composition of the engine.
"""
from __future__ import annotations

import hashlib
import struct


def sample_seed(run_seed: int, purpose: str, step: int, epoch: int, row: int, sample: int) -> int:
    """A 63-bit seed for sample ``sample`` of dataset row ``row`` drawn in ``epoch`` at ``step``."""
    h = hashlib.blake2b(purpose.encode() + struct.pack("<Qqqqq", run_seed, step, epoch, row, sample), digest_size=8)
    return int.from_bytes(h.digest(), "little") & (2**63 - 1)


def group_seeds(run_seed: int, purpose: str, step: int, epoch: int, rows: list[int], n: int) -> list[list[int]]:
    """[P][n] seeds of P prompts (dataset rows) with n samples each."""
    return [[sample_seed(run_seed, purpose, step, epoch, r, j) for j in range(n)] for r in rows]
