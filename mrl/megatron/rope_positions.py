"""RoPE at given position ids for Megatron's ``GPTModel``.

``GPTModel`` rotates column ``t`` of a row by position ``t`` and ignores ``position_ids``, which is
right for compact left-aligned rows. The shared-prefix layout (:func:`mrl.workers.minibatch.build_shared_prefix_inputs`)
puts several samples' continuations in one row, each at the positions it has in its own sequence, and a
packed row (:func:`mrl.workers.minibatch.build_packed_inputs`) several whole sequences, each from position 0,
so the rotation must follow ``position_ids``; with context parallelism (:mod:`mrl.megatron.context_parallel`) a
rank's row holds two chunks of every sequence, rotated by their global positions. :func:`enable_rope_positions` wraps the model's
``rotary_pos_emb`` once; :func:`set_rope_positions` sets the positions of the next forward (``None``:
Megatron's own behaviour). Megatron's unfused RoPE broadcasts a per-sample ``[L, b, 1, d]`` table
exactly as its ``[L, 1, 1, d]`` one (``apply_rope_fusion`` is off in mrl's configs).
"""
from __future__ import annotations

import torch

_ATTR = "_mrl_rope_positions"


def enable_rope_positions(model: torch.nn.Module) -> None:
    """Let ``model.rotary_pos_emb`` (Megatron ``RotaryEmbedding``, or ``YarnRotaryEmbedding`` whose forward returns
    the table with its attention factor) follow :func:`set_rope_positions`."""
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None or hasattr(rope, _ATTR):
        return
    inner = rope.forward
    setattr(rope, _ATTR, None)

    def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        pos = getattr(rope, _ATTR)
        if pos is None:
            return inner(max_seq_len, offset, packed_seq, cp_group)
        # max_seq_len is the row's length, or with mrl's packed rows (PackedSeqParams, qkv_format "sbhd") the
        # longest sequence of the row: the table below covers whatever positions are asked for.
        if offset or packed_seq:
            raise ValueError(f"RoPE at positions: {tuple(pos.shape)} position ids (offset {offset}, THD packing "
                             f"{packed_seq}) — only BSHD rows are supported")
        # [S, 1, 1, d]: angle of position s. packed_seq=True keeps Megatron from cutting the table into its CP
        # zigzag share: with context parallelism pos already holds this rank's global positions.
        table = inner(int(pos.max()) + 1, 0, True)
        if isinstance(table, tuple):  # YaRN's embedding returns (table, attention factor)
            return table[0][:, 0][pos.t()], *table[1:]
        return table[:, 0][pos.t()]  # [L, b, 1, d]

    rope.forward = forward


def set_rope_positions(model: torch.nn.Module, position_ids: torch.Tensor | None) -> None:
    """Position ids [b, L] of the next forward of ``model`` (enabled by :func:`enable_rope_positions`)."""
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None:
        return
    if not hasattr(rope, _ATTR):
        if position_ids is None:
            return
        raise RuntimeError("RoPE positions were not enabled on this model (enable_rope_positions)")
    setattr(rope, _ATTR, position_ids)
