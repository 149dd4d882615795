"""Rank body of the DeepSeek-V3 parity test (module-level so spawn can pickle it)."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.megatron._ranks import pipeline_logits

# (tp, pp, ep, etp): 4 ranks. TP2 splits MLA's projections by heads (and the latent down-projections by rows,
# gathered right after) and the experts over ETP=TP; EP2 x PP2 also exports the HF tensors (round trip).
DS_LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 2), (1, 1, 2, 1), (1, 2, 1, 1), (1, 2, 2, 1)]
DS_ROUNDTRIP = (1, 2, 2)
# added to the trainer's score-correction bias in the replay check: moves many choices, none of the weights
BIAS_SHIFT = 0.3 * torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0, 1.0, -1.0] * 2).roll(3)
# (case, dispatcher, layout) runs: the q_lora model everywhere with the all-to-all dispatcher and at EP2 with the
# allgather one; the model without q_lora (its attention differs, its experts do not) at TP1, TP2 and EP2 x PP2.
DS_RUNS = ([("q_lora", "alltoall", lay) for lay in DS_LAYOUTS] + [("q_lora", "allgather", (1, 1, 2, 1))]
           + [("no_q_lora_mtp", "alltoall", lay) for lay in ((1, 1, 1, 1), (2, 1, 1, 2), (1, 2, 2, 1))])


def deepseek_parity_rank(rank: int, world: int, root: str) -> dict:
    """max |Δlogits| against each case's ref.pt per (case, dispatcher, tp, pp, ep); at EP2×PP2 each stage
    exports its HF tensors into ``root/rt_<case>/stage<pp>``."""
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
    for tp, pp, ep, etp in DS_LAYOUTS:
        init_parallel(device="cpu", tp=tp, pp=pp, ep=ep, etp=etp)
        if (tp, pp, ep, etp) == (1, 1, 1, 1):
            out["replay"] = _replay_check(Path(root) / "q_lora")
        for case, disp, layout in DS_RUNS:
            if layout != (tp, pp, ep, etp):
                continue
            path = Path(root) / case
            ref = torch.load(path / "ref.pt", weights_only=True)
            cfg = load_hf_config(path)
            chunks = build_model_chunks(cfg, config_overrides={"moe_token_dispatcher_type": disp})
            load_hf_weights(chunks, cfg, HFCheckpointReader(path))
            logits = pipeline_logits(chunks, cfg, ref["ids"])
            if logits is not None:
                out[(case, disp, tp, pp, ep)] = (logits - ref["logits"]).abs().max().item()
            if (case, disp, layout) == DS_RUNS[0]:
                out["bias_update"] = _expert_bias_after_a_step(chunks, ref["ids"])
            if (tp, pp, ep) == DS_ROUNDTRIP:
                stage_dir = Path(root) / f"rt_{case}" / f"stage{ps.get_pipeline_model_parallel_rank()}"
                names = hf_names_for_stage(chunks, cfg)
                tensors = list(export_hf_weights(chunks, cfg))  # collective over EP: every rank iterates
                assert sorted(n for n, _ in tensors) == sorted(names), "export and name list disagree"
                if ps.get_expert_model_parallel_rank() == 0:
                    write_hf_checkpoint(stage_dir, tensors)
    return out


def _expert_bias_after_a_step(chunks: list, ids: torch.Tensor) -> dict:
    """One training forward + backward, then Megatron's end-of-step expert-bias update (the part of
    ``finalize_model_grads`` that touches it): with mrl's ``moe_router_bias_update_rate=0`` and, as a control,
    with Megatron's default rate."""
    from megatron.core.distributed.finalize_model_grads import (
        _update_router_expert_bias,
    )

    model = chunks[0]
    routers = [m for m in model.modules() if getattr(m, "expert_bias", None) is not None]
    before = [r.expert_bias.clone() for r in routers]
    model.train()
    model(ids, torch.arange(ids.shape[1]).expand_as(ids), None).sum().backward()
    counted = int(sum(r.local_tokens_per_expert.sum() for r in routers))
    rate = model.config.moe_router_bias_update_rate
    _update_router_expert_bias(chunks, model.config)
    frozen = all(torch.equal(b, r.expert_bias) for b, r in zip(before, routers))
    model.config.moe_router_bias_update_rate = 1e-3  # Megatron's default: the aux-loss-free update
    _update_router_expert_bias(chunks, model.config)
    moved = not any(torch.equal(b, r.expert_bias) for b, r in zip(before, routers))
    model.config.moe_router_bias_update_rate = rate
    return {"rate": rate, "routers": len(routers), "tokens_counted": counted, "frozen": frozen,
            "moved_at_default_rate": moved, "fp32": all(r.expert_bias.dtype == torch.float32 for r in routers)}


def _replay_check(path: Path) -> dict:
    """Routing replay (R3) on DeepSeek-V3's router: the trainer's score-correction bias shifted by
    :data:`BIAS_SHIFT` (its own choice then differs from transformers'); with transformers' expert ids
    (``ref.pt["routed"]``) replayed through mrl's router probes, the logits are transformers' again, because the
    bias steers only the choice, never the weights."""
    from mrl.megatron.hf_io import HFCheckpointReader
    from mrl.megatron.mapping import load_hf_weights
    from mrl.megatron.provider import build_model_chunks, load_hf_config
    from mrl.workers.routing_replay import install_probes, set_targets

    cfg = load_hf_config(path)
    ref = torch.load(path / "ref.pt", weights_only=True)
    chunks = build_model_chunks(cfg, config_overrides={"moe_enable_routing_replay": True})
    load_hf_weights(chunks, cfg, HFCheckpointReader(path))
    model = chunks[0].eval()
    ids = ref["ids"]
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        for m in model.modules():
            if getattr(m, "expert_bias", None) is not None:
                m.expert_bias += BIAS_SHIFT
        own = model(ids, pos, None)[..., : cfg.vocab_size]
        probes = install_probes(chunks)
        set_targets(probes, ref["routed"].long())
        replayed = model(ids, pos, None)[..., : cfg.vocab_size]
    return {"own": (own - ref["logits"]).abs().max().item(), "replayed": (replayed - ref["logits"]).abs().max().item(),
            "mismatch": int(sum(p.mismatch for p in probes)), "compared": int(sum(p.compared for p in probes))}
