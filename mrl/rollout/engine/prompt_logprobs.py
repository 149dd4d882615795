"""Log-probs of a prompt's own tokens (SGLang's ``input_token_logprobs``), e.g. for ``sgl.select``.

For prompt tokens t_0 .. t_{L-1}, start s (``logprob_start_len``) and temperature T (0 = 1, as
for output tokens; see :mod:`mrl.rollout.engine.sampling`)::

    input_token_logprobs = [(None, t_s)] + [(log_softmax(z_{k-1} / T)[t_k], t_k) for k in s+1 .. L-1]

where z_{k-1} are the logits the model gives at position k-1 (predicting t_k): one unpadded
``transformers`` forward of the prompt, so the values are the oracle's own. The first entry has
no log-prob, as in SGLang (it drops the last position's — the first output token's — and shifts
by one). ``top_logprobs_num`` k adds the k most likely tokens of the same distributions
(``None`` for the first entry).
"""
from __future__ import annotations

import torch

from mrl.rollout.engine.model_runner import ModelRunner


@torch.inference_mode()
def prompt_logprobs(runner: ModelRunner, ids: list[int], start: int, temperature: float,
                    top_num: int) -> tuple[list[tuple[float | None, int]], list[list[tuple[float, int]] | None]]:
    """(input_token_logprobs, input_top_logprobs) of ``ids`` from position ``start`` (see the module
    docstring). The caller holds the scheduler's ``model_lock`` (no weight update mid-forward)."""
    if not 0 <= start < len(ids):
        return [], []
    logits = runner.model(input_ids=torch.tensor([ids], device=runner.device)).logits[0, start:-1].float()
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)  # [L-1-start, V]: row j predicts ids[start + 1 + j]
    nxt = torch.tensor(ids[start + 1:], device=lp.device)
    chosen = lp.gather(1, nxt[:, None]).squeeze(1).tolist() if len(nxt) else []
    tokens: list[tuple[float | None, int]] = [(None, ids[start])] + list(zip(chosen, ids[start + 1:]))
    if top_num <= 0:
        return tokens, []
    vals, idx = torch.topk(lp, min(top_num, lp.shape[-1]), dim=-1)
    return tokens, [None] + [list(zip(v, i)) for v, i in zip(vals.tolist(), idx.tolist())]
