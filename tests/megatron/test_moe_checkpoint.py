"""MoE checkpoints: weights saved at EP2×PP2 load at EP1×PP1 (and at TP2) and export the same HF
tensors bit for bit; Megatron's dist checkpoint stores experts under global expert indices."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf

pytestmark = pytest.mark.multirank


def _rank(rank: int, world: int, hf_dir: str, ckpt_dir: str) -> dict:
    from mrl.megatron.checkpoint import load_checkpoint, save_checkpoint
    from mrl.megatron.hf_io import HFCheckpointReader
    from mrl.megatron.mapping import export_hf_weights, load_hf_weights
    from mrl.megatron.parallel import init_parallel
    from mrl.megatron.provider import build_model_chunks, load_hf_config

    cfg = load_hf_config(hf_dir)
    reader = HFCheckpointReader(hf_dir)
    init_parallel(device="cpu", tp=1, pp=2, ep=2)
    chunks = build_model_chunks(cfg)
    load_hf_weights(chunks, cfg, reader)
    save_checkpoint(ckpt_dir, chunks, extra={"step": 3}, hf_config=cfg)
    out = {}
    for tp, pp, ep in ((1, 1, 1), (2, 1, 1), (1, 1, 4)):
        init_parallel(device="cpu", tp=tp, pp=pp, ep=ep)
        chunks = build_model_chunks(cfg)
        extra = load_checkpoint(ckpt_dir, chunks)
        exported = dict(export_hf_weights(chunks, cfg))
        bad = [n for n, t in exported.items() if not torch.equal(t, reader.get(n))]
        out[(tp, pp, ep)] = {"extra": extra, "bad": bad, "n": len(exported)}
    return out


@pytest.mark.parametrize("family", ["qwen2_moe"])
def test_moe_checkpoint_saved_at_ep2_pp2_loads_at_other_layouts(tmp_path: Path, family: str) -> None:
    from mrl.megatron.hf_io import HFCheckpointReader

    hf = make_tiny_hf(tmp_path / "hf", family)
    results = run_ranks(_rank, 4, args=(str(hf), str(tmp_path / "ckpt")), timeout_s=400, init_process_group=False)
    n = len(HFCheckpointReader(hf).names())
    for r in results:
        for layout, res in r.items():
            assert res["extra"] == {"step": 3}, layout
            assert res["bad"] == [] and res["n"] == n, (layout, res["bad"][:3])
