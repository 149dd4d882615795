"""Pure parts of mrl.megatron.mapping: QKV interleaving and the spec-name resolver."""
from __future__ import annotations

import torch

from mrl.megatron.mapping import (
    FAMILY_TABLES,
    SPLITS,
    TE_RENAMES,
    _merge_qkv,
    _param,
    _split_qkv,
)
from tests.helpers.tiny_models import hf_config


def test_qkv_interleave_per_group_and_inverse():
    cfg = hf_config("llama")  # 4 heads, 2 kv groups, head_dim 16, hidden 64
    d = 16
    q = torch.arange(4 * d)[:, None].float().expand(-1, 64)
    k = 1000 + torch.arange(2 * d)[:, None].float().expand(-1, 64)
    v = 2000 + torch.arange(2 * d)[:, None].float().expand(-1, 64)
    fused = _merge_qkv(q, k, v, cfg)
    assert fused.shape == (2 * (2 + 2) * d, 64)
    # Group 0 = q heads 0,1 then k head 0 then v head 0 (Megatron's per-query-group layout).
    assert torch.equal(fused[: 2 * d, 0], q[: 2 * d, 0])
    assert torch.equal(fused[2 * d: 3 * d, 0], k[:d, 0])
    assert torch.equal(fused[3 * d: 4 * d, 0], v[:d, 0])
    assert torch.equal(fused[4 * d: 6 * d, 0], q[2 * d:, 0])
    for a, b in zip(_split_qkv(fused, cfg), (q, k, v)):
        assert torch.equal(a, b)
    bias = torch.randn(4 * d), torch.randn(2 * d), torch.randn(2 * d)
    for a, b in zip(_split_qkv(_merge_qkv(*bias, cfg), cfg), bias):
        assert torch.equal(a, b)


def test_tables_are_well_formed():
    for fam, table in FAMILY_TABLES.items():
        assert all(r.split in SPLITS for r in table), fam
        mc = [r.mcore for r in table]
        assert len(mc) == len(set(mc)), f"{fam}: duplicate Megatron name"
        hf = [n for r in table for n in r.hf]
        assert len(hf) == len(set(hf)), f"{fam}: duplicate HF name"
    assert any("q_norm" in n for r in FAMILY_TABLES["qwen3"] for n in r.hf)
    assert any(r.mcore.endswith("linear_qkv.bias") for r in FAMILY_TABLES["qwen2"])


def test_resolver_finds_te_fused_layernorm_names():
    class TELike(torch.nn.Module):
        """Parameter layout of a TE-spec layer: the layernorms live inside linear_qkv/linear_fc1."""

        def __init__(self):
            super().__init__()
            self.self_attention = torch.nn.Module()
            self.self_attention.linear_qkv = torch.nn.Module()
            self.self_attention.linear_qkv.layer_norm_weight = torch.nn.Parameter(torch.ones(3))
            self.mlp = torch.nn.Module()
            self.mlp.linear_fc1 = torch.nn.Module()
            self.mlp.linear_fc1.layer_norm_weight = torch.nn.Parameter(torch.ones(3))

    m = TELike()
    assert set(TE_RENAMES) == {"input_layernorm.weight", "pre_mlp_layernorm.weight"}
    assert _param(dict(m.named_parameters()), "input_layernorm.weight") is m.self_attention.linear_qkv.layer_norm_weight
    assert _param(dict(m.named_parameters()), "pre_mlp_layernorm.weight") is m.mlp.linear_fc1.layer_norm_weight
    assert _param(dict(m.named_parameters()), "mlp.linear_fc2.weight") is None


def test_fused_x_at_w_experts_read_either_layout(monkeypatch):
    """Qwen3-VL-MoE's expert e: released ``gate_up_proj[e] [H, 2F] = [gate | up]`` (x @ W) and transformers 5's
    saved transpose ``[2F, H]`` give the same Megatron fc1 ``[gate; up]`` (``[2F, H]``, gate rows first); ``down_proj``
    ``[F, H]`` or ``[H, F]`` the same fc2 ``[H, F]``; export writes the released layout."""
    from mrl.families import FAMILIES
    from mrl.megatron import mapping

    monkeypatch.setattr(mapping, "_tp", lambda expert=False: (1, 0, None))  # ETP1: no collective
    rules = {r.mcore.rsplit(".", 2)[-2]: r for r in FAMILIES["qwen3_vl_moe"].weight_rules if r.fused}
    h, f = 6, 4
    w = torch.randn(h, 2 * f, dtype=torch.float64)
    d = torch.randn(f, h, dtype=torch.float64)
    for fc1 in (w, w.t()):
        local = mapping._to_local(rules["linear_fc1"], [fc1], None, torch.Size([2 * f, h]))
        assert torch.equal(local, torch.cat([w[:, :f].t(), w[:, f:].t()]))
    assert torch.equal(mapping._to_hf(rules["linear_fc1"], local, None)[0], w)
    for fc2 in (d, d.t()):
        local = mapping._to_local(rules["linear_fc2"], [fc2], None, torch.Size([h, f]))
        assert torch.equal(local, d.t())
    assert torch.equal(mapping._to_hf(rules["linear_fc2"], local, None)[0], d)
