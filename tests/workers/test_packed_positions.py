"""Positions of packed rows (mrl/workers/minibatch.py ``build_packed_inputs``) and the RoPE rotation they get
(mrl/megatron/rope_positions.py): every sequence of the row restarts at position 0 — ragged lengths, a sequence of
one token (a sample whose response is empty, and the alignment padding) — so column ``o_i + t`` is rotated as
position ``t`` of sample i alone.

Why a unit test: RoPE is relative, so positions that keep counting across a packed row's sequences shift each
sequence by a constant and change attention only through float rounding of the larger angles (1e-5 at 8k tokens
in tests/workers/test_long_sequences.py, invisible at the lengths of the layout tests). The expected values here
are built with their own index arithmetic from the stored batch, not from mrl's compact builder.
"""
from __future__ import annotations

import torch

from mrl.workers.batch import TrainBatch

P, R = 4, 3


def _batch() -> TrainBatch:
    """Left-padded prompts of 4, 1, 2, 3 tokens and right-padded responses of 3, 0 (a one-token sequence), 1, 2."""
    p_len, r_len = torch.tensor([4, 1, 2, 3]), torch.tensor([3, 0, 1, 2])
    B = len(p_len)
    cols = torch.arange(P + R)
    am = ((cols[None] >= (P - p_len)[:, None]) & (cols[None] < (P + r_len)[:, None])).long()
    ids = (torch.arange(B * (P + R)).view(B, P + R) + 3) * am  # distinct tokens: where each came from is visible
    pos = (am.cumsum(-1) - 1).clamp(min=0) * am
    z = torch.zeros(B, R)
    return TrainBatch(input_ids=ids, attention_mask=am, position_ids=pos, responses=ids[:, P:].clone(),
                      response_mask=am[:, P:].clone(), old_log_probs=z, advantages=z, uid=torch.arange(B))


def _sequences(batch: TrainBatch) -> list[torch.Tensor]:
    """Each sample's valid tokens in order (prompt then response), from the stored batch."""
    return [batch.input_ids[i][batch.attention_mask[i].bool()] for i in range(batch.batch_size)]


def test_packed_positions_restart_at_every_sequence():
    from mrl.workers.minibatch import build_packed_inputs

    batch = _batch()
    seqs = _sequences(batch)
    lengths = [len(s) for s in seqs]
    assert lengths == [7, 1, 3, 5]  # ragged, one sequence of a single token
    total = sum(lengths)
    mi = build_packed_inputs(batch, pad_to_multiple=total + 1)  # alignment padding: one more one-token sequence
    assert mi.tokens.shape == (1, total + 1)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    assert mi.cu_seqlens.tolist() == bounds + [total + 1]
    want_pos = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(1, dtype=torch.long)])
    assert torch.equal(mi.position_ids[0], want_pos)  # 0..6 | 0 | 0..2 | 0..4 | 0
    assert torch.equal(mi.tokens[0, :total], torch.cat(seqs)) and int(mi.tokens[0, total]) == 0
    for k, (s, e) in enumerate(zip(mi.cu_seqlens[:-1].tolist(), mi.cu_seqlens[1:].tolist())):
        assert int(mi.position_ids[0, s]) == 0, f"sequence {k} starts at position {int(mi.position_ids[0, s])}"


def test_packed_positions_are_the_stored_position_ids_of_each_sample():
    """Left padding gives each sample's stored ``position_ids`` 0..n-1 over its valid tokens: the packed row carries
    exactly those values, sample after sample."""
    from mrl.workers.minibatch import build_packed_inputs

    batch = _batch()
    mi = build_packed_inputs(batch)
    stored = torch.cat([batch.position_ids[i][batch.attention_mask[i].bool()] for i in range(batch.batch_size)])
    assert torch.equal(mi.position_ids[0], stored)


def test_rope_rotates_each_packed_sequence_as_if_alone():
    """Megatron's RotaryEmbedding behind mrl's positions wrapper, fed the packed row's positions: the table row of
    column o_i + t is the table's row t (the angle of position t), for every sequence including the one-token ones."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        RotaryEmbedding,
    )

    from mrl.megatron.cpu_support import cpu_support
    from mrl.megatron.rope_positions import enable_rope_positions, set_rope_positions
    from mrl.workers.minibatch import build_packed_inputs

    batch = _batch()
    lengths = [len(s) for s in _sequences(batch)]
    mi = build_packed_inputs(batch, pad_to_multiple=sum(lengths) + 1)
    with cpu_support():
        rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
        alone = rope(max(lengths))  # [7, 1, 1, 16]: positions 0..6 of a sequence on its own
        holder = torch.nn.Module()
        holder.rotary_pos_emb = rope
        enable_rope_positions(holder)
        set_rope_positions(holder, mi.position_ids)
        packed = rope(mi.tokens.shape[1])  # [L, 1, 1, 16]
    assert packed.shape == (mi.tokens.shape[1], 1, 1, 16)
    for s, e in zip(mi.cu_seqlens[:-1].tolist(), mi.cu_seqlens[1:].tolist()):
        assert torch.equal(packed[s:e, 0, 0], alone[: e - s, 0, 0]), (s, e)
    # the check's power: a row that kept counting would be rotated by the angles of positions 7, 8, ...
    assert not torch.equal(alone[1, 0, 0], alone[0, 0, 0])
