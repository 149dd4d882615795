"""The lightning indexer's selection (mrl/megatron/dsa.py) does not depend on how many query rows it scores at once:
the per-head score blocks that bound its memory on long rows give the same mask as one block (single process; the
parity with transformers is tests/megatron/test_dsa_parity.py, whose 20-token rows fit in one block)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from mrl.megatron import dsa


def test_query_blocks_give_the_one_block_mask(monkeypatch):
    cfg = SimpleNamespace(dsa_indexer_n_heads=4, dsa_indexer_head_dim=8, dsa_indexer_topk=5, qk_pos_emb_head_dim=4,
                          params_dtype=torch.float32, use_cpu_initialization=True, q_lora_rank=12, hidden_size=16)
    torch.manual_seed(0)
    ix = dsa.LightningIndexer(cfg, rope_interleaved=True)
    with torch.no_grad():
        for p in ix.parameters():
            p.normal_()
    s, b = 37, 2
    x, qr = torch.randn(s, b, 16), torch.randn(s, b, 12)
    freqs = (torch.arange(s, dtype=torch.float32)[:, None] * torch.tensor([1.0, 0.1, 1.0, 0.1]))[:, None, None]
    whole = ix.keep(x, qr, freqs, 1.0)
    monkeypatch.setattr(dsa, "SCORE_BUDGET", b * cfg.dsa_indexer_n_heads * s * 3)  # 3 query rows per block
    blocked = ix.keep(x, qr, freqs, 1.0)
    assert torch.equal(whole, blocked)
    assert whole.sum(-1).tolist() == [[min(i + 1, 5) for i in range(s)]] * b  # top-5 of the causal keys
    assert not whole.triu(1).any()
