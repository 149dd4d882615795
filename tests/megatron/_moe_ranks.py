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
# Models mixing dense and MoE layers run on these (the first dispatcher only); EP2 x PP2 for the round trip.
MIXED_LAYOUTS = [(1, 1, 1, 1, False), (1, 1, 2, 1, False), (1, 2, 1, 1, False), (1, 2, 2, 1, False)]
# Models whose experts have biases (gpt-oss: Megatron needs ETP=1) run on these, with both dispatchers.
ETP1_LAYOUTS = [(1, 1, 1, 1, False), (2, 1, 1, 1, False), (1, 1, 2, 1, False), (1, 2, 1, 1, False),
                (1, 2, 2, 1, False), (2, 1, 2, 1, False)]
ROUNDTRIP = (1, 2, 2)  # (tp, pp, ep) at which every stage exports its HF tensors


def moe_parity_rank(rank: int, world: int, root: str, families: list[str], dispatchers: list[str],
                    mixed: list[str] = (), etp1: list[str] = ()) -> dict:
    """For each layout, case and dispatcher: max |Δlogits| against ref.pt (a case is a checkpoint directory
    under ``root``: the ``families`` on every layout and dispatcher, the ``mixed`` ones on
    :data:`MIXED_LAYOUTS` with the first dispatcher, the ``etp1`` ones on :data:`ETP1_LAYOUTS` with every
    dispatcher); at EP2×PP2 each stage exports its HF tensors into ``root/rt_<case>/stage<pp>`` (experts
    gathered over EP)."""
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
    layouts = MOE_LAYOUTS + [lay for lay in ETP1_LAYOUTS if lay not in MOE_LAYOUTS]
    for layout in layouts:
        tp, pp, ep, etp, sp = layout
        cases = [(f, dispatchers) for f in families] if layout in MOE_LAYOUTS else []
        if layout in MIXED_LAYOUTS:
            cases += [(m, dispatchers[:1]) for m in mixed]
        if layout in ETP1_LAYOUTS:
            cases += [(c, dispatchers) for c in etp1]
        if not cases:
            continue
        init_parallel(device="cpu", tp=tp, pp=pp, ep=ep, etp=etp)
        for case, disps in cases:
            for disp in disps:
                path = Path(root) / case
                ref = torch.load(path / "ref.pt", weights_only=True)
                cfg = load_hf_config(path)
                chunks = build_model_chunks(cfg, config_overrides={
                    "moe_token_dispatcher_type": disp, "sequence_parallel": sp})
                load_hf_weights(chunks, cfg, HFCheckpointReader(path))
                logits = pipeline_logits(chunks, cfg, ref["ids"])
                if logits is not None:
                    out[(case, disp, tp, pp, ep, etp)] = (logits - ref["logits"]).abs().max().item()
                if case in etp1 and layout == ETP1_LAYOUTS[0] and disp == dispatchers[0]:
                    out[(case, "grads")] = _grads_vs_reference(path, cfg)
                if (tp, pp, ep) == ROUNDTRIP and disp == dispatchers[0]:
                    stage_dir = Path(root) / f"rt_{case}" / f"stage{ps.get_pipeline_model_parallel_rank()}"
                    names = hf_names_for_stage(chunks, cfg)
                    tensors = list(export_hf_weights(chunks, cfg))  # collective over EP: every rank iterates
                    assert sorted(n for n, _ in tensors) == sorted(names), "export and name list disagree"
                    if ps.get_expert_model_parallel_rank() == 0:
                        write_hf_checkpoint(stage_dir, tensors)
    return out


def _grads_vs_reference(path: Path, cfg) -> float:
    """TP1/EP1 (every rank alone): gradients of ``sum(logits · w)`` for every HF tensor, in HF layout (each grad
    exported through the weight rules in place of its parameter), against ``grads.pt`` (transformers' autograd);
    max |Δ| over all tensors divided by the largest reference gradient. The aux loss is off: transformers'
    gradient of the logits has none."""
    from mrl.megatron.hf_io import HFCheckpointReader
    from mrl.megatron.mapping import export_hf_weights, load_hf_weights
    from mrl.megatron.provider import build_model_chunks

    ref = torch.load(path / "grads.pt", weights_only=True)
    chunks = build_model_chunks(cfg, config_overrides={"moe_aux_loss_coeff": 0.0})
    load_hf_weights(chunks, cfg, HFCheckpointReader(path))
    model = chunks[0]
    ids = ref["ids"]
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    logits = model(ids, pos, None)[..., : cfg.vocab_size]
    (logits * ref["w"]).sum().backward()
    params = list(model.parameters())
    saved = [p.data for p in params]
    for p in params:
        p.data = p.grad if p.grad is not None else torch.zeros_like(p)
    grads = dict(export_hf_weights(chunks, cfg))
    for p, data in zip(params, saved):
        p.data = data
    assert sorted(grads) == sorted(ref["grads"]), "the exported gradients do not cover the checkpoint's tensors"
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    return max(float((grads[n] - g).abs().max()) for n, g in ref["grads"].items()) / scale
