"""Rank body of tests/workers/test_mla_actor.py: a DeepSeek-V3 (multi-latent attention) actor on padded and on packed
rows (one gloo rank, world size 1)."""
from __future__ import annotations

import torch


def padded_and_packed(rank, world, path: str) -> dict:
    """{"lp": {packed: [B, R] log-probs}, "grad": {packed: the accumulated gradient, one fp32 vector},
    "qkv_format": the packed forward's PackedSeqParams format}."""
    import mrl.workers.megatron_model as mm
    from mrl.config.actor import ActorConfig
    from mrl.megatron.parallel import init_parallel
    from mrl.workers.actor import ActorWorker
    from tests.workers.batches import ragged_batch

    init_parallel(device="cpu", seed=1234)  # once: both actors below share the world-size-1 parallel state
    formats: list[str] = []
    real = mm._packed_seq_params

    def seen(*a, **kw):
        p = real(*a, **kw)
        formats.append(p.qkv_format)
        return p

    mm._packed_seq_params = seen
    cfg = ActorConfig(ppo_micro_batch_size_per_gpu=4, optim={"lr": 1e-3, "clip_grad": 1.0})
    rb = ragged_batch(vocab=96)
    out: dict = {"lp": {}, "grad": {}}
    for packed in (False, True):
        actor = ActorWorker(cfg, model_path=path, mini_batch_size_samples=8, seed=1234, dtype=torch.float32,
                            init_parallel=False, attention_backend="sdpa", remove_padding=packed)
        out["lp"][packed] = actor.compute_log_prob(rb)[0]
        actor.forward_backward(rb)
        out["grad"][packed] = torch.cat([p.main_grad.detach().float().flatten() for c in actor.model.chunks
                                         for p in c.parameters() if p.requires_grad])
        del actor
    out["qkv_format"] = sorted(set(formats))
    return out
