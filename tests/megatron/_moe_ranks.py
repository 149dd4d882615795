"""Rank body of the MoE model-layer tests (module-level so spawn can pickle it)."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.megatron._ranks import pipeline_logits

# (tp, pp, ep, etp, sequence_parallel): the layouts the MoE parity test runs on 4 ranks.
MOE_LAYOUTS = [
    (1, 1, 1, 1, False),  # reference layout
    (2, 1, 1, 2, False),  # TP2: attention and experts split over TP (ETP = TP, Megatron's default)
    (1, 1, 2, 1, False),  # EP2: two experts per rank, tokens all-to-all
    (1, 2, 1, 1, False),  # PP2
    (1, 2, 2, 1, False),  # EP2 x PP2 on 4 ranks
    (2, 1, 2, 1, False),  # TP2 with EP2 folded over it (ETP1)
]


def moe_parity_rank(rank: int, world: int, root: str, families: list[str], dispatchers: list[str]) -> dict:
    """For each layout, family and dispatcher: max |Δlogits| against ref.pt; at EP2×PP2 each stage
    exports its HF tensors into ``root/rt_<family>/stage<pp>`` (experts gathered over EP)."""
    from megatron.core import parallel_state as ps

    from mrl.megatron.hf_io import HFCheckpointReader, write_hf_checkpoint
    from mrl.megatron.mapping import (
        export_hf_weights,
        hf_names_for_stage,
        load_hf_weights,
    )
    from mrl.megatron.parallel import init_parallel
    from mrl.megatron.provider import build_model_chunks, load_hf_config

    out: dict = {}
    for tp, pp, ep, etp, sp in MOE_LAYOUTS:
        init_parallel(device="cpu", tp=tp, pp=pp, ep=ep, etp=etp)
        for fam in families:
            for disp in dispatchers:
                path = Path(root) / fam
                ref = torch.load(path / "ref.pt", weights_only=True)
                cfg = load_hf_config(path)
                chunks = build_model_chunks(cfg, config_overrides={
                    "moe_token_dispatcher_type": disp, "sequence_parallel": sp})
                load_hf_weights(chunks, cfg, HFCheckpointReader(path))
                logits = pipeline_logits(chunks, cfg, ref["ids"])
                if logits is not None:
                    out[(fam, disp, tp, pp, ep, etp)] = (logits - ref["logits"]).abs().max().item()
                if (tp, pp, ep) == (1, 2, 2) and disp == dispatchers[0]:
                    stage_dir = Path(root) / f"rt_{fam}" / f"stage{ps.get_pipeline_model_parallel_rank()}"
                    names = hf_names_for_stage(chunks, cfg)
                    tensors = list(export_hf_weights(chunks, cfg))  # collective over EP: every rank iterates
                    assert sorted(n for n, _ in tensors) == sorted(names), "export and name list disagree"
                    if ps.get_expert_model_parallel_rank() == 0:
                        write_hf_checkpoint(stage_dir, tensors)
    return out
