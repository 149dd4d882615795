"""Rank body of the vision-language parity test (module-level so spawn can pickle it)."""
from __future__ import annotations

from pathlib import Path

import torch

KINDS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5")
DENSE_LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1)]  # (tp, pp, ep) over 2 ranks (TP1: two data-parallel replicas)
# Qwen3-VL-MoE at TP1: its 4 experts over 2 expert-parallel ranks (each rank's tokens dispatched to both), and PP2
# Qwen3.5 (its Gated DeltaNet layers run on no positions) at TP1 and TP2 only: the suite's time budget
LAYOUTS = {"qwen2_5_vl": DENSE_LAYOUTS, "qwen3_vl": DENSE_LAYOUTS, "qwen3_vl_moe": [(1, 1, 2), (1, 2, 1)],
           "qwen3_5": [(1, 1, 1), (2, 1, 1)]}
PARTS = [[0, 1], [2, 3]]  # two micro-batches: pictures of several samples in one forward
ROUNDTRIP = {(2, 1, 1), (1, 2, 1), (1, 1, 2)}


def _logits(model, batch, packed: bool, vocab: int) -> list[torch.Tensor] | None:
    """Each sample's full-vocab logits [n_i, V] through MegatronModel.run (forward only), on the last stage."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    out: dict[int, torch.Tensor] = {}

    def loss_func(mb, output):
        full = gather_from_tensor_model_parallel_region(output)[..., :vocab].detach()
        inp, ids = mb.inputs, mb.extra["ids"]
        for k, i in enumerate(ids):
            n = int(inp.num_tokens[k])
            a = int(inp.cu_seqlens[k]) if inp.cu_seqlens is not None else 0
            out[i] = full[0 if inp.cu_seqlens is not None else k, a:a + n]
        return output.sum() * 0.0, {}

    mbs = model.make_micro_batches(batch, PARTS, packed=packed)
    for mb, part in zip(mbs, PARTS):
        mb.extra["ids"] = part
    with torch.no_grad():
        model.run(mbs, loss_func, forward_only=True)
    return [out[i] for i in range(batch.batch_size)] if model.is_last_stage else None


def vlm_parity_rank(rank: int, world: int, root: str) -> dict:
    from megatron.core import parallel_state as ps

    from mrl.config.parallel import ParallelConfig
    from mrl.megatron.hf_io import write_hf_checkpoint
    from mrl.workers.megatron_model import MegatronModel

    out: dict = {}
    for kind in KINDS:
        path = Path(root) / kind
        ref = torch.load(path / "ref.pt", weights_only=False)
        for tp, pp, ep in LAYOUTS[kind]:
            par = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
            for packed in (False, True):
                model = MegatronModel(path, par, train=False, attention_backend="sdpa", remove_padding=packed)
                logits = _logits(model, ref["batch"], packed, ref["vocab"])
                if logits is not None:
                    out[(kind, tp, pp, ep, packed)] = [(lg.double() - r).abs().max().item()
                                                   for lg, r in zip(logits, ref["logits"])]
                    out[("lg", kind, tp, pp, ep, packed)] = logits
                if not packed and (tp, pp, ep) in ROUNDTRIP:
                    tensors = list(model.named_parameters_hf())  # collective: every rank iterates
                    if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
                        stage = Path(root) / f"rt_{kind}_tp{tp}pp{pp}ep{ep}" / f"stage{ps.get_pipeline_model_parallel_rank()}"
                        write_hf_checkpoint(stage, tensors)
    return out
