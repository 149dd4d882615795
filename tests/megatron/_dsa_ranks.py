"""Rank body of the DeepSeek sparse attention parity test (module-level so spawn can pickle it)."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.megatron._qwen3_5_ranks import _logits

# (tp, pp) on 2 ranks: TP1 (DP2), TP2 (MLA's heads split, the indexer replicated), PP2 (two layers per stage)
LAYOUTS = [(1, 1), (2, 1), (1, 2)]
CASES = ("deepseek_v32", "glm_moe_dsa")
PACKED_LENGTHS = (13, 1, 7, 19)  # ragged, one of length 1, most longer than index_topk; 40 tokens: TP2 splits them
DENSE_TOPK = 1 << 10  # >= every row: the indexer keeps every earlier token (dense MLA)


def _packed_vs_alone(chunks, hf_config) -> float:
    """One packed row of ``PACKED_LENGTHS`` sequences (``cu_seqlens``, positions restarting) vs each sequence alone
    as its own row: max |Δlogits|."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from mrl.megatron.unwrap import unwrap

    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, hf_config.vocab_size, (n,), generator=gen) for n in PACKED_LENGTHS]
    model = unwrap(chunks[0]).eval()
    cu = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in PACKED_LENGTHS])[None]
    # MLA reads packed rows as THD (mrl.workers.megatron_model._packed_seq_params)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(PACKED_LENGTHS),
                             max_seqlen_kv=max(PACKED_LENGTHS))
    full = lambda o: gather_from_tensor_model_parallel_region(o)[..., : hf_config.vocab_size]
    with torch.no_grad():
        packed = full(model(torch.cat(seqs)[None], pos, None, packed_seq_params=params))[0]
        alone = torch.cat([full(model(s[None], torch.arange(len(s))[None], None))[0] for s in seqs])
    return (packed - alone).abs().max().item()


def _frozen(chunks, hf_config, ids) -> dict:
    """A training forward/backward through a DDP-wrapped model and mrl's optimizer: the indexer's parameters get
    no gradient and are not among the optimizer's; every other parameter is."""
    from mrl.config.optim import OptimConfig
    from mrl.workers.optim import build_optimizer

    opt = build_optimizer(chunks, OptimConfig(lr=1e-3), use_distributed_optimizer=False)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    model = chunks[0].train()
    model(ids, torch.arange(ids.shape[1]).expand_as(ids), None).sum().backward()
    named = list(model.named_parameters())
    indexer = [(n, p) for n, p in named if ".indexer." in n]
    return {"indexer_tensors": len(indexer), "indexer_frozen": all(not p.requires_grad for _, p in indexer),
            "indexer_grads": sum(p.grad is not None or getattr(p, "main_grad", None) is not None for _, p in indexer),
            "indexer_in_optimizer": sum(id(p) in in_opt for _, p in indexer),
            "others_trainable": all(p.requires_grad for n, p in named if ".indexer." not in n)}


def _grads(chunks, hf_config, ids) -> dict:
    """d(sum of the real-vocabulary logits)/d(weight) by Megatron's backward (TP1, train mode), under HF names."""
    from tests.megatron._deepseek_ranks import _hf_named_grads

    model = chunks[0].train()
    model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)[..., : hf_config.vocab_size].sum().backward()
    return _hf_named_grads(chunks, hf_config)


def dsa_parity_rank(rank: int, world: int, root: str) -> dict:
    from megatron.core import parallel_state as ps

    from mrl.megatron.hf_io import HFCheckpointReader, write_hf_checkpoint
    from mrl.megatron.mapping import export_hf_weights, load_hf_weights
    from mrl.megatron.parallel import init_parallel
    from mrl.megatron.provider import build_model_chunks, load_hf_config

    out: dict = {}
    for tp, pp in LAYOUTS:
        init_parallel(device="cpu", tp=tp, pp=pp, ep=1, etp=tp)
        for case in CASES:
            path = Path(root) / case
            ref = torch.load(path / "ref.pt", weights_only=True)
            cfg = load_hf_config(path)
            over: dict = {}
            chunks = build_model_chunks(cfg, config_overrides=over)
            load_hf_weights(chunks, cfg, HFCheckpointReader(path))
            logits = _logits(chunks, cfg, ref["ids"])
            if logits is not None:  # the last stage's
                out[(case, tp, pp)] = (logits.double() - ref["logits"]).abs().max().item()
            if pp == 2:
                continue
            out[("packed", case, tp)] = _packed_vs_alone(chunks, cfg)
            if tp == 2:
                tensors = list(export_hf_weights(chunks, cfg))  # collective: every rank iterates
                if ps.get_tensor_model_parallel_rank() == 0:
                    write_hf_checkpoint(Path(root) / f"rt_{case}", tensors)
            if tp == 1:
                dense = build_model_chunks(cfg, config_overrides={**over, "dsa_indexer_topk": DENSE_TOPK})
                load_hf_weights(dense, cfg, HFCheckpointReader(path))
                out[("dense", case)] = (_logits(dense, cfg, ref["ids"]).double() - ref["logits"]).abs().max().item()
                out[("grads", case)] = _grads(chunks, cfg, ref["ids"])
                ddp = build_model_chunks(cfg, wrap_ddp=True, config_overrides=over)
                out[("frozen", case)] = _frozen(ddp, cfg, ref["ids"])
    return out
