"""Response embeddings for ``algorithm.repr_align`` (docs/driver.md, "Reward shaping"): a worker-side forward.

``e_i = (1/|A_i|) Σ_{t∈A_i} h_t`` with ``h_t`` ∈ R^H the last layer's hidden state after the final
norm at the answer tokens ``A_i`` (the response part of the batch, ``attention_mask[:, P:]``), so
the driver needs no second HF model. Output [B, H], identical on every rank, caller's order.
"""
from __future__ import annotations

import torch

from mrl.workers.batch import TrainBatch
from mrl.workers.minibatch import at_least, restore_order, split_by_length


def response_embedding(model, batch: TrainBatch, *, micro_batch_size: int) -> torch.Tensor:
    local = model.dp_shard(batch)
    # similar lengths together
    parts = at_least(split_by_length(local.seq_lengths().tolist(), micro_batch_size), model.min_micro_batches)
    mbs = model.make_micro_batches(local, parts, packed=False)  # loss_func reads compact columns
    H = model.hf_config.hidden_size
    captured: dict[int, torch.Tensor] = {}

    def hook(mb, hidden):  # hidden [L, b, H] (sequence-first inside Megatron)
        captured[id(mb)] = hidden.detach().transpose(0, 1).float()

    def loss_func(mb, _out):
        h = captured.pop(id(mb))  # [b, L, H]
        # answer token j sits at compact column resp_index + 1
        cols = (mb.inputs.resp_index + 1) * mb.inputs.resp_valid
        w = mb.inputs.resp_valid.to(h.device, h.dtype)  # inputs are built on the host
        g = h.gather(1, cols[..., None].expand(-1, -1, H).to(h.device))  # [b, R, H]
        emb = (g * w[..., None]).sum(1) / w.sum(1, keepdim=True).clamp(min=1)
        return torch.zeros((), device=h.device), {"emb": emb}

    model.set_train(False)
    with torch.no_grad():
        out = model.run(mbs, loss_func, forward_only=True, hidden_hook=hook)
    if model.is_last_stage:
        emb = restore_order([o["emb"] for o in out], parts).to(model.device)
    else:
        emb = torch.zeros(local.batch_size, H, device=model.device)
    emb = model.broadcast_from_last_stage(emb)
    return model.all_gather_dp(emb).cpu()
