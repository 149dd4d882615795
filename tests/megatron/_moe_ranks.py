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
FROZEN_BIAS_LAYOUT = (1, 1, 2, 1, False)  # where a sigmoid router's expert_bias goes through one train step


def expert_bias_after_train_step(path: Path) -> float:
    """One forward/backward through Megatron's schedule with ``finalize_model_grads`` (the trainer's grad
    finalisation, which applies the aux-loss-free bias update) on a DDP-wrapped model of ``path``: max |Δ| of
    every router ``expert_bias`` against the checkpoint's ``e_score_correction_bias`` (0.0: frozen, as mrl
    sets ``moe_router_bias_update_rate=0``). The routers must have counted tokens, or nothing was tested."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mrl.megatron.hf_io import HFCheckpointReader
    from mrl.megatron.mapping import load_hf_weights
    from mrl.megatron.provider import build_model_chunks, load_hf_config
    from tests.megatron._ranks import MICRO_BATCH, SEQ

    cfg = load_hf_config(path)
    reader = HFCheckpointReader(path)
    chunks = build_model_chunks(cfg, wrap_ddp=True)
    load_hf_weights(chunks, cfg, reader)
    chunks[0].module.config.finalize_model_grads_func = finalize_model_grads
    routers = [(layer.layer_number - 1, layer.mlp.router) for layer in chunks[0].module.decoder.layers
               if hasattr(layer.mlp, "router")]
    assert routers and all(r.expert_bias is not None for _, r in routers)
    counted: list[float] = []  # tokens the routers counted for the bias update (finalize_model_grads zeroes them)
    ids = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)

    def step(data_iter, model):
        batch = next(data_iter)
        out = model(batch[:, :-1], pos, None)

        def loss_func(logits):
            counted.append(sum(float(r.local_tokens_per_expert.sum()) for _, r in routers))
            return logits.float().square().mean(), {}

        return out, loss_func

    for c in chunks:
        c.train()
        c.zero_grad_buffer()
    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([ids]), model=chunks, num_microbatches=1,
                                seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False)
    assert counted and counted[0] > 0, "the routers counted no tokens: the bias update had nothing to move"
    return max(float((r.expert_bias - reader.get(f"model.layers.{i}.mlp.gate.e_score_correction_bias")).abs().max())
               for i, r in routers)


def replayed_logits(path: Path) -> dict[str, float]:
    """Routing replay (R3) through mrl's router probes: Megatron (this layout, ``moe_enable_routing_replay``) fed the
    engine's expert ids of ``path/replay.pt`` (a transformers model whose routers' score-correction bias differs
    from the checkpoint's: the bias only chooses, so the same weights with the engine's choice give the engine's
    logits) -> max |Δ| to the engine's logits with the ids replayed (``replay``) and without (``own``)."""
    from mrl.megatron.hf_io import HFCheckpointReader
    from mrl.megatron.mapping import load_hf_weights
    from mrl.megatron.provider import build_model_chunks, load_hf_config
    from mrl.workers.routing_replay import install_probes, set_targets
    from tests.megatron._ranks import MICRO_BATCH, SEQ

    cfg = load_hf_config(path)
    ref, engine = torch.load(path / "ref.pt", weights_only=True), torch.load(path / "replay.pt", weights_only=True)
    chunks = build_model_chunks(cfg, config_overrides={"moe_enable_routing_replay": True})
    load_hf_weights(chunks, cfg, HFCheckpointReader(path))
    model = chunks[0].eval()
    probes = install_probes(chunks)
    pos = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    out = {}
    with torch.no_grad():
        for mode in ("replay", "own"):
            diffs = []
            for ids, routed, want in zip(ref["ids"].split(MICRO_BATCH), engine["routed"].split(MICRO_BATCH),
                                         engine["logits"].split(MICRO_BATCH)):
                set_targets(probes, routed if mode == "replay" else None)
                logits = model(ids, pos, None)[..., : cfg.vocab_size]
                diffs.append(float((logits - want).abs().max()))
            out[mode] = max(diffs)
    set_targets(probes, None)
    return out


def bf16_replayed_error(path: Path) -> dict[str, float]:
    """This layout's (TP1/EP1) model of ``path`` in bf16 (Float16Module: bf16 weights and activations, fp32 logits
    out) with every router replaying the fp32 truth's expert ids of ``path/bf16.pt`` (mrl's router probes, R3: its
    own probabilities at those experts) -> max and mean |Δ| of its logits to the fp32 truth's. Replay keeps a
    near-tie that bf16 rounding flips from standing in for the precision of the rest (docs/moe.md, gpt-oss)."""
    from mrl.megatron.hf_io import HFCheckpointReader
    from mrl.megatron.mapping import load_hf_weights
    from mrl.megatron.provider import build_model_chunks, load_hf_config
    from mrl.workers.routing_replay import install_probes, set_targets

    cfg = load_hf_config(path)
    ref = torch.load(path / "bf16.pt", weights_only=True)
    chunks = build_model_chunks(cfg, dtype=torch.bfloat16, config_overrides={"moe_enable_routing_replay": True})
    load_hf_weights(chunks, cfg, HFCheckpointReader(path))
    model = chunks[0].eval()
    probes = install_probes(chunks)
    ids = ref["ids"]
    set_targets(probes, ref["routed"])
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)[..., : cfg.vocab_size]
    set_targets(probes, None)
    diff = (logits.float() - ref["truth"]).abs()
    return {"max": float(diff.max()), "mean": float(diff.mean())}


def lora_export(path: Path) -> None:
    """LoRA (all-linear, rank 4) on this layout's model of ``path`` with random B (the merge must move): rank 0
    writes ``path/lora.pt`` = {"peft": export_peft_tensors, "merged": the merged HF export} (experts gathered)."""
    import torch.distributed as dist

    from mrl.megatron.hf_io import HFCheckpointReader
    from mrl.megatron.lora import apply_lora, export_peft_tensors
    from mrl.megatron.mapping import export_hf_weights, load_hf_weights
    from mrl.megatron.provider import build_model_chunks, load_hf_config

    cfg = load_hf_config(path)
    chunks = build_model_chunks(cfg)
    load_hf_weights(chunks, cfg, HFCheckpointReader(path))
    adapters = apply_lora(chunks, cfg, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"), rank=4, alpha=8.0, dropout=0.0, seed=0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for ad in adapters:
            for b in ad.B.values():
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    peft = dict(export_peft_tensors(chunks))
    merged = dict(export_hf_weights(chunks, cfg))
    if dist.get_rank() == 0:
        torch.save({"peft": peft, "merged": merged}, path / "lora.pt")


def moe_parity_rank(rank: int, world: int, root: str, families: list[str], dispatchers: list[str],
                    mixed: list[str] = (), etp1: list[str] = (), frozen_bias: list[str] = ()) -> dict:
    """For each layout, case and dispatcher: max |Δlogits| against ref.pt (a case is a checkpoint directory
    under ``root``: the ``families`` on every layout and dispatcher, the ``mixed`` ones on
    :data:`MIXED_LAYOUTS` with the first dispatcher, the ``etp1`` ones on :data:`ETP1_LAYOUTS` with every
    dispatcher); at EP2×PP2 each stage exports its HF tensors into ``root/rt_<case>/stage<pp>`` (experts
    gathered over EP). At :data:`FROZEN_BIAS_LAYOUT` each ``frozen_bias`` case also trains one step:
    ``("expert_bias", case)`` -> max |Δ expert_bias| (:func:`expert_bias_after_train_step`), replays an engine's
    routing: ``("replay" | "own", case)`` -> max |Δlogits| (:func:`replayed_logits`), and writes its LoRA adapters
    and merged export (:func:`lora_export`). At TP1 rank 0 also runs each ``etp1`` case that has a ``bf16.pt`` in
    bf16: ``(case, "bf16", "max" | "mean")`` (:func:`bf16_replayed_error`)."""
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
        if not cases and layout != FROZEN_BIAS_LAYOUT:
            continue
        init_parallel(device="cpu", tp=tp, pp=pp, ep=ep, etp=etp)
        if layout == FROZEN_BIAS_LAYOUT:
            for case in frozen_bias:
                out[("expert_bias", case)] = expert_bias_after_train_step(Path(root) / case)
                for mode, diff in replayed_logits(Path(root) / case).items():
                    out[(mode, case)] = diff
                lora_export(Path(root) / case)
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
                    if rank == 0 and (path / "bf16.pt").exists():
                        for stat, value in bf16_replayed_error(path).items():
                            out[(case, "bf16", stat)] = value
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
