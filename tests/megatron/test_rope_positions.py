"""RoPE at given position ids (mrl/megatron/rope_positions.py) for YaRN, whose Megatron embedding returns its table
with the attention factor: at positions ``pos`` the wrapped embedding gives the rows ``pos`` of its own full table
and the same factor (packed rows restart positions at every sequence)."""
from __future__ import annotations

import math

import torch


def test_yarn_table_at_positions_keeps_the_attention_factor():
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
    )

    from mrl.megatron.cpu_support import cpu_support
    from mrl.megatron.rope_positions import enable_rope_positions, set_rope_positions

    with cpu_support():  # Megatron moves YaRN's frequencies to "the current CUDA device"
        rope = YarnRotaryEmbedding(kv_channels=16, rotary_base=10000.0, use_cpu_initialization=True,
                                   scaling_factor=4.0, original_max_position_embeddings=64, beta_fast=8.0,
                                   beta_slow=1.0, mscale=None, mscale_all_dim=None,
                                   correction_range_round_to_int=False)
        full, factor = rope(8)  # [8, 1, 1, 16], 0.1 ln 4 + 1
        holder = torch.nn.Module()
        holder.rotary_pos_emb = rope
        enable_rope_positions(holder)
        pos = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 5, 6, 7]])  # [b, L]: row 0 packs two sequences
        set_rope_positions(holder, pos)
        table, got_factor = rope(5)
    assert got_factor == factor and abs(factor - (0.1 * math.log(4.0) + 1)) < 1e-12
    assert table.shape == (5, 2, 1, 16)
    assert torch.equal(table[:, 0, 0], full[pos[0], 0, 0]) and torch.equal(table[:, 1, 0], full[pos[1], 0, 0])
