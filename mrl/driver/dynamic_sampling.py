"""DAPO dynamic sampling (``algorithm.filter_groups``): the kept groups of several generation
rounds become one step's batch.

Each round is a scored ``StepData`` of ``data.gen_batch_size`` prompts × n samples and a keep mask
(``informative_groups``, constant per group). Kept prompts are taken in round order until
``data.train_batch_size`` are collected (verl truncates the same way) and the step's batch is
re-assembled from their dataset rows and engine answers, so rounds with different padded widths
merge exactly: the result is what one generation of those prompts would have produced.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from mrl.driver.batch import assemble_train_batch
from mrl.rewards.manager import place_on_last_token
from mrl.rollout.types import RolloutResult


def kept_prompts(rounds: Sequence[tuple[Any, torch.Tensor]], n: int) -> int:
    """Kept prompts over ``rounds`` (each keep mask is [P·n], constant within a group)."""
    return sum(int(keep.view(-1, n)[:, 0].sum()) for _, keep in rounds)


def unique_uids(rows: Sequence[int], num_rows: int) -> list[int]:
    """Dataset rows as group uids; a row drawn again in a later round (the sampler wrapped an epoch)
    is a different group, so its k-th repeat gets ``row + k·num_rows``."""
    seen: Counter[int] = Counter()
    out = []
    for r in rows:
        out.append(r + seen[r] * num_rows)
        seen[r] += 1
    return out


def merge_rounds(rounds: Sequence[tuple[Any, torch.Tensor]], *, n: int, max_prompts: int, dataset: Any,
                 pad_token_id: int, routed_experts: bool = False) -> dict[str, Any]:
    """The fields of one ``StepData`` from the kept groups of ``rounds``, at most ``max_prompts`` prompts.

    Each round's data carries ``rows`` [P], ``result`` (its ``RolloutResult``, P·n samples in
    prompt-major order), ``prompts``/``texts`` [P·n], ``scores``/``valid`` [B] and
    ``reward_extra_info`` (key -> [B]); ``token_level_scores`` [B, R] are re-placed on the last
    response token of the merged batch (their per-sample sums carry over).
    """
    rows: list[int] = []
    pick: list[tuple[int, int]] = []  # (round, sample index) of every kept sample, in batch order
    for k, (d, keep) in enumerate(rounds):
        for p, kept in enumerate(keep.view(-1, n)[:, 0].tolist()):
            if kept and len(rows) < max_prompts:
                rows.append(d.rows[p])
                pick += [(k, p * n + j) for j in range(n)]

    def take(get) -> list:
        return [get(rounds[k][0])[i] for k, i in pick]

    samples = [dataclasses.replace(s, prompt_index=q // n, sample_index=q % n)
               for q, s in enumerate(take(lambda d: d.result.samples))]
    batch = assemble_train_batch(dataset.collate(rows), RolloutResult(samples, n), pad_token_id=pad_token_id,
                                 uids=unique_uids(rows, len(dataset)), routed_experts=routed_experts)
    seq_scores = torch.stack(take(lambda d: d.token_level_scores.sum(-1)))
    keys = list(rounds[0][0].reward_extra_info or {})
    return {
        "batch": batch, "rows": rows, "result": RolloutResult(samples, n),
        "prompts": take(lambda d: d.prompts), "texts": take(lambda d: d.texts),
        "token_level_scores": place_on_last_token(seq_scores, batch.response_mask),
        "scores": torch.stack(take(lambda d: d.scores)), "valid": torch.stack(take(lambda d: d.valid)),
        "reward_extra_info": {key: take(lambda d, key=key: d.reward_extra_info[key]) for key in keys},
    }
