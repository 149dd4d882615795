"""A fixed ragged TrainBatch for the worker tests (left-padded prompts, right-padded responses)."""
from __future__ import annotations

import torch

from mrl.workers.batch import RESPONSE_KEYS, TrainBatch


def ragged_batch(
    B: int = 8, P: int = 6, R: int = 7, vocab: int = 300, seed: int = 0, with_ref: bool = True,
    with_rollout: bool = False,
) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(2, P + 1, (B,), generator=g)
    r_len = torch.randint(1, R + 1, (B,), generator=g)
    p_len[0], r_len[0] = P, R  # one full-width sample so padding widths are exercised
    ids = torch.randint(3, vocab, (B, P + R), generator=g)
    cols = torch.arange(P + R)
    am = ((cols[None, :] >= (P - p_len)[:, None]) & (cols[None, :] < (P + r_len)[:, None])).long()
    ids = ids * am
    pos = (am.cumsum(-1) - 1).clamp(min=0) * am
    resp_mask = am[:, P:].clone()
    if B > 2:
        resp_mask[2, 0] = 0  # a masked token inside a response (e.g. tool output)
    lp = lambda: -torch.rand(B, R, generator=g) * 3 * resp_mask
    return TrainBatch(
        input_ids=ids, attention_mask=am, position_ids=pos, responses=ids[:, P:].clone(),
        response_mask=resp_mask,
        old_log_probs=lp(),
        advantages=torch.randn(B, R, generator=g) * resp_mask,
        ref_log_prob=lp() if with_ref else None,
        rollout_log_probs=lp() if with_rollout else None,
        uid=torch.arange(B) // 2,
    )


def grouped_batch(groups: int = 4, n: int = 4, P: int = 6, R: int = 7, vocab: int = 300, seed: int = 0
                  ) -> TrainBatch:
    """GRPO-shaped ragged batch: ``groups`` prompts (left-padded, 2..P tokens) × ``n`` samples each,
    adjacent, with ragged responses (1..R tokens; one masked response token)."""
    g = torch.Generator().manual_seed(seed)
    B = groups * n
    p_len = torch.randint(2, P + 1, (groups,), generator=g).repeat_interleave(n)
    r_len = torch.randint(1, R + 1, (B,), generator=g)
    p_len[:n], r_len[0] = P, R  # full widths somewhere
    prompts = torch.randint(3, vocab, (groups, P), generator=g).repeat_interleave(n, 0)
    ids = torch.cat([prompts, torch.randint(3, vocab, (B, R), generator=g)], 1)
    cols = torch.arange(P + R)
    am = ((cols[None, :] >= (P - p_len)[:, None]) & (cols[None, :] < (P + r_len)[:, None])).long()
    ids = ids * am
    pos = (am.cumsum(-1) - 1).clamp(min=0) * am
    resp_mask = am[:, P:].clone()
    resp_mask[1, 0] = 0  # a masked response token (e.g. tool output): attended, not trained
    lp = lambda: -torch.rand(B, R, generator=g) * 3 * resp_mask
    return TrainBatch(
        input_ids=ids, attention_mask=am, position_ids=pos, responses=ids[:, P:].clone(), response_mask=resp_mask,
        old_log_probs=lp(), advantages=torch.randn(B, R, generator=g) * resp_mask, ref_log_prob=lp(),
        uid=torch.arange(B) // n,
    )


def portable(obj):
    """Tensors → numpy, recursively, for values returned from ``run_ranks``.

    torch tensors sent through a multiprocessing queue are shared by file descriptor, which the
    parent can only fetch while the sending rank is alive; ranks exit right after reporting, so
    the parent may hang. numpy arrays pickle by value.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(portable(v) for v in obj)
    return obj


def tensors(obj):
    """Inverse of :func:`portable`."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tensors(v) for v in obj)
    return obj


def with_response_width(batch: TrainBatch, width: int) -> TrainBatch:
    """The same samples with the response part padded (zero columns) or trimmed to ``width``.

    Trimming only drops columns where ``attention_mask`` is 0 for every sample. Models see the
    same tokens either way (inputs are compacted), only the padded width R changes.
    """
    P, R = batch.prompt_length, batch.response_length
    if width < R:
        if bool(batch.attention_mask[:, P + width:].any()):
            raise ValueError(f"cannot trim responses to {width}: valid tokens beyond it")
        fix = lambda t, start: t[:, : start + width]
    else:
        def fix(t, start):
            return torch.cat([t, torch.zeros(t.shape[0], width - R, dtype=t.dtype)], dim=1)
    out = {}
    for name in ("input_ids", "attention_mask", "position_ids"):
        out[name] = fix(getattr(batch, name), P)
    for name in ("responses", "response_mask", *RESPONSE_KEYS):
        t = getattr(batch, name)
        out[name] = None if t is None else fix(t, 0)
    return TrainBatch(**out, uid=batch.uid)
