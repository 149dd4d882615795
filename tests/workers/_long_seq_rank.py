"""Rank body of tests/workers/test_long_sequences.py (module-level: the launcher pickles it by reference).

One gloo rank builds one actor, warms it up on a short batch, then runs ``update_policy`` once per length
(ascending) and records ``ru_maxrss`` after each: the growth over the warm baseline is that update's peak
(maxrss is a high-water mark and the lengths ascend, so each later reading is the later update's own peak).
"""
from __future__ import annotations

import resource
import time

import torch

PROMPT = 64  # prompt tokens of every sample; the rest of a sample is its response
SHORT = 256  # tokens of the short sample packed after the long one


def long_batch(lengths: list[int], vocab: int, seed: int = 0):
    """A TrainBatch of samples with ``lengths`` valid tokens each (PROMPT of prompt, the rest response,
    right-padded to the longest), with the loss inputs the actor reads (old/ref log-probs, advantages)."""
    from mrl.workers.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    B, R = len(lengths), max(lengths) - PROMPT
    ids = torch.randint(3, vocab, (B, PROMPT + R), generator=g)
    n = torch.tensor(lengths)
    am = (torch.arange(PROMPT + R)[None, :] < n[:, None]).long()
    ids = ids * am
    pos = (am.cumsum(-1) - 1).clamp(min=0) * am
    resp_mask = am[:, PROMPT:].clone()
    lp = lambda: -torch.rand(B, R, generator=g) * 3 * resp_mask
    return TrainBatch(input_ids=ids, attention_mask=am, position_ids=pos, responses=ids[:, PROMPT:].clone(),
                      response_mask=resp_mask, old_log_probs=lp(), advantages=torch.randn(B, R, generator=g) * resp_mask,
                      ref_log_prob=lp(), uid=torch.arange(B))


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def measure(rank, world, path, backend: str, remove_padding: bool, lengths: list[int], check_lp: bool):
    """{"baseline": MiB, "peaks": {N: maxrss MiB after the update at N}, "seconds": {N: s}, "metrics": {N: ...},
    "lp_packed"/"lp_alone": [R] log-probs of the longest sample (packed with the short one / alone, compact)}."""
    from mrl.config.actor import ActorConfig
    from mrl.workers.actor import ActorWorker, forward_log_probs

    cfg = ActorConfig(
        megatron={"attention_backend": backend}, use_remove_padding=remove_padding,
        ppo_micro_batch_size_per_gpu=2,  # both samples in one micro-batch: one packed row
        use_distributed_optimizer=False, use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01,
        optim={"lr": 1e-4, "clip_grad": 1.0},
    )
    actor = ActorWorker(cfg, model_path=path, mini_batch_size_samples=2, seed=1234,
                        remove_padding=remove_padding, attention_backend=backend)
    vocab = actor.vocab_size
    actor.update_policy(long_batch([PROMPT + 64, PROMPT + 32], vocab, seed=1))  # optimizer state, kernels, caches
    out = {"baseline": _maxrss_mib(), "peaks": {}, "seconds": {}, "metrics": {}}
    for n in sorted(lengths):
        batch = long_batch([n, SHORT], vocab, seed=n)
        t0 = time.perf_counter()
        m = actor.update_policy(batch)
        out["seconds"][n] = time.perf_counter() - t0
        out["peaks"][n] = _maxrss_mib()
        out["metrics"][n] = {k: float(v) for k, v in m.items()}
    if check_lp:  # after the last update, same weights: the packed row vs each sample alone in a compact row
        kw = {"temperature": 1.0, "use_dynamic_bsz": False, "max_tokens": 0, "vocab_size": vocab,
              "chunk_size": cfg.logits_chunk_size}
        e = actor.model
        lp_packed = forward_log_probs(e, batch, micro_batch_size=2, **kw).log_probs
        e.remove_padding = False
        lp_alone = forward_log_probs(e, batch, micro_batch_size=1, **kw).log_probs
        e.remove_padding = remove_padding
        out["lp_packed"], out["lp_alone"] = lp_packed.numpy(), lp_alone.numpy()
        out["resp_mask"] = batch.response_mask.numpy()
    return out
