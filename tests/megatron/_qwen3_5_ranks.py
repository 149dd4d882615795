"""Rank body of the Qwen3.5 parity test (module-level so spawn can pickle it)."""
from __future__ import annotations

from pathlib import Path

import torch

# (tp, pp, ep) layouts of 4 ranks and the cases each runs
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (1, 2, 2)]
# (kept to what each case adds: the text-only form's names, the MoE's experts over EP and stages, Qwen3-Next's
# grouped projection split over TP)
RUNS = {"dense": [(1, 1, 1), (2, 1, 1), (1, 2, 1)], "text_only": [(1, 1, 1)],
        "moe": [(1, 1, 1), (1, 2, 2)], "next": [(2, 1, 1), (1, 1, 2)]}
ROUNDTRIP = {"dense": (2, 1, 1), "moe": (1, 2, 2), "next": (2, 1, 1)}
PACKED_LENGTHS = (70, 1, 33, 2)  # ragged, across the 64-token chunk of the delta rule, one of length 1


def _logits(chunks, hf_config, ids):
    """Full-vocab logits through Megatron's schedule (forward only), on the last stage; None elsewhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    b, s = ids.shape
    pos = torch.arange(s).expand(b, s)

    def step(data_iter, model):
        out = model(next(data_iter), pos, None)
        return out, lambda o: (o.sum() * 0.0, {"logits": gather_from_tensor_model_parallel_region(o)[
            ..., : hf_config.vocab_size].detach()})

    for c in chunks:
        c.eval()
    with torch.no_grad():
        store = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([ids]), model=chunks[0],
                                            num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True)
    return torch.cat([d["logits"] for d in store]) if ps.is_pipeline_last_stage() else None


def _packed_vs_alone(chunks, hf_config) -> float:
    """One packed row of ``PACKED_LENGTHS`` sequences (positions restart, ``cu_seqlens``) vs each sequence alone:
    max |Δlogits| (single-stage layouts)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from mrl.megatron.rope_positions import enable_rope_positions, set_rope_positions
    from mrl.megatron.unwrap import unwrap

    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, hf_config.vocab_size, (n,), generator=gen) for n in PACKED_LENGTHS]
    model = unwrap(chunks[0])
    model.eval()
    enable_rope_positions(model)
    cu = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(n) for n in PACKED_LENGTHS])[None]
    params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(PACKED_LENGTHS),
                             max_seqlen_kv=max(PACKED_LENGTHS))
    full = lambda o: gather_from_tensor_model_parallel_region(o)[..., : hf_config.vocab_size]
    with torch.no_grad():
        set_rope_positions(model, pos)
        packed = full(model(ids, pos, None, packed_seq_params=params))[0]
        set_rope_positions(model, None)
        alone = torch.cat([full(model(s[None], torch.arange(len(s))[None], None))[0] for s in seqs])
    return (packed - alone).abs().max().item()


def qwen3_5_parity_rank(rank: int, world: int, root: str) -> dict:
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
    for tp, pp, ep in LAYOUTS:
        init_parallel(device="cpu", tp=tp, pp=pp, ep=ep, etp=1)
        for case, layouts in RUNS.items():
            if (tp, pp, ep) not in layouts:
                continue
            path = Path(root) / case
            ref = torch.load(path / "ref.pt", weights_only=True)
            cfg = load_hf_config(path)
            chunks = build_model_chunks(cfg)
            load_hf_weights(chunks, cfg, HFCheckpointReader(path))
            logits = _logits(chunks, cfg, ref["ids"])
            if logits is not None:
                out[(case, tp, pp, ep)] = (logits.double() - ref["logits"]).abs().max().item()
            if pp == 1 and ep == 1:
                out[("packed", case, tp)] = _packed_vs_alone(chunks, cfg)
            if ROUNDTRIP.get(case) == (tp, pp, ep):
                names = hf_names_for_stage(chunks, cfg)
                tensors = list(export_hf_weights(chunks, cfg))  # collective: every rank iterates
                assert sorted(n for n, _ in tensors) == sorted(names), "export and name list disagree"
                if ps.get_tensor_model_parallel_rank() == 0 and ps.get_expert_model_parallel_rank() == 0:
                    stage = Path(root) / f"rt_{case}" / f"stage{ps.get_pipeline_model_parallel_rank()}"
                    write_hf_checkpoint(stage, tensors)
    return out
