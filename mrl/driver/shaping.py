"""Driver side of the reward shaping (docs/driver.md, "Reward shaping"): ``ref_reward_blend`` and ``repr_align.ref_alignment``.

Runs after KL-in-reward and before the advantages (docs/driver.md, "Reward shaping")::

    r  <- (1 - w_b) * r + w_b * minmax(ref_log_prob) * m          (ref_reward_blend)
    r  <- r + w_a * cos(e_gen, e_gold) * m / |m|   if H_batch >= threshold   (repr_align)

``w_b``, ``w_a`` = ``schedule_weight(schedule, step, total_steps, max_weight, warmup_ratio)`` with
``step`` the number of steps finished before this one (0 on the first step, so the first step
has ``w = 0`` when warmup_ratio > 0). ``H_batch`` = masked mean of the old-policy token entropy over
the response tokens. ``e_gen`` / ``e_gold`` come from the reference weights (the initial policy,
seed: "the same HF model") on prompt + generated vs prompt + gold tokens; the forward is the
workers' (``ColocatedReference.compute_repr_similarity``), the driver only builds the gold batch.

Pure torch (no Ray, no Megatron) so the logic is unit-tested with plain tensors.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mrl.algorithms import blend_ref_reward, repr_align_bonus, schedule_weight
from mrl.workers.batch import TrainBatch

BLEND = "actor/ref_blend"
ALIGN = "actor/repr/ref_gold_align"


def ref_blend(cfg: Any, rewards: torch.Tensor, ref_log_prob: torch.Tensor | None, response_mask: torch.Tensor, *,
              step: int, total_steps: int, metrics: dict[str, float]) -> torch.Tensor:
    """``(1 - w) r + w minmax(ref_log_prob) m`` [B, R] with the scheduled ``w`` (cfg: RefRewardBlendConfig)."""
    if ref_log_prob is None:
        raise RuntimeError("algorithm.ref_reward_blend.enable=true but the batch has no ref_log_prob; "
                           "fix: leave ref.enable null (or true) so the reference is built")
    w = schedule_weight(cfg.schedule, step, total_steps, cfg.max_weight, cfg.warmup_ratio, cfg.steps)
    metrics[f"{BLEND}/weight"] = w
    return blend_ref_reward(rewards, ref_log_prob, response_mask, w)


def batch_mean_entropy(entropys: torch.Tensor, response_mask: torch.Tensor) -> float:
    """``sum(H * m) / sum(m)`` over the whole batch [B, R] (0 when no token is valid)."""
    m = response_mask.to(entropys.dtype)
    return float((entropys * m).sum() / m.sum().clamp(min=1))


def repr_align(cfg: Any, rewards: torch.Tensor, response_mask: torch.Tensor, entropys: torch.Tensor, *,
               step: int, total_steps: int, similarity: Callable[[], torch.Tensor],
               metrics: dict[str, float]) -> torch.Tensor:
    """``r + w * sim_i * m / |m|`` [B, R] when the batch mean entropy >= cfg.entropy_high_threshold, else ``r``.

    ``similarity()`` returns the [B] cosine similarities; it is only called when the gate is open
    (it costs two reference forwards). cfg: RefAlignmentConfig (its ``steps`` is the schedule default, 3).
    """
    w = schedule_weight(cfg.schedule, step, total_steps, cfg.max_weight, cfg.warmup_ratio)
    h = batch_mean_entropy(entropys, response_mask)
    applied = h >= cfg.entropy_high_threshold
    metrics |= {f"{ALIGN}/weight": w, f"{ALIGN}/batch_entropy": h, f"{ALIGN}/applied": float(applied)}
    if not applied:
        return rewards
    sim = similarity().to(rewards.dtype)
    metrics |= {f"{ALIGN}/similarity/mean": float(sim.mean()), f"{ALIGN}/similarity/min": float(sim.min()),
                f"{ALIGN}/similarity/max": float(sim.max())}
    return rewards + repr_align_bonus(sim, response_mask, w)


def gold_text(ground_truth: Any, source: str, key: str) -> str:
    """The gold answer as text: a non-empty string as is, a number via ``str``; anything else is an error
    naming the row (``source`` = "file:row") and ``data.ground_truth_key``."""
    if isinstance(ground_truth, (int, float)) and not isinstance(ground_truth, bool):
        return str(ground_truth)
    if isinstance(ground_truth, str) and ground_truth.strip():
        return ground_truth
    raise ValueError(
        f"{source or '<unknown row>'}: algorithm.repr_align needs a gold answer but column {key!r} "
        f"(data.ground_truth_key) holds {ground_truth!r}; fix: give every training row a non-empty text or "
        "number there, point data.ground_truth_key at the answer column, or set algorithm.repr_align.enable=false"
    )


def check_gold_answers(prompts: Sequence[Any], key: str) -> None:
    """Fail before training when a training row has no usable gold answer (see ``gold_text``)."""
    for p in prompts:
        gold_text(p.ground_truth, p.source, key)


def encode_gold(tokenizer: Any, prompts: Sequence[Any], *, key: str, max_length: int) -> list[list[int]]:
    """Gold token ids per sample: ``tokenize(gold_text)`` (no special tokens) + EOS, cut to ``max_length``.

    EOS is appended (when the tokenizer has one) because a finished generation ends with it, so a
    response that reproduces the gold answer token for token has similarity 1.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    out = []
    for p in prompts:
        ids = list(tokenizer(gold_text(p.ground_truth, p.source, key), add_special_tokens=False)["input_ids"])
        out.append((ids + ([int(eos)] if eos is not None else []))[:max_length])
    return out


def build_gold_batch(batch: TrainBatch, gold_ids: Sequence[Sequence[int]], *, pad_token_id: int) -> TrainBatch:
    """prompt (the batch's own left-padded [B, P] columns) + gold answer right-padded to G = longest gold.

    Same layout as ``assemble_train_batch``: positions continue ``last_prompt_pos + 1 + t`` and
    ``response_mask`` is 1 on the gold tokens. Only the model inputs are set (no log-probs etc.).
    """
    B, P = batch.batch_size, batch.prompt_length
    if len(gold_ids) != B:
        raise ValueError(f"build_gold_batch: {len(gold_ids)} gold answers for {B} samples")
    G = max(1, max((len(g) for g in gold_ids), default=0))
    resp = torch.full((B, G), pad_token_id, dtype=batch.input_ids.dtype)
    mask = torch.zeros((B, G), dtype=batch.attention_mask.dtype)
    for i, g in enumerate(gold_ids):
        if g:
            resp[i, :len(g)] = torch.as_tensor(list(g), dtype=resp.dtype)
            mask[i, :len(g)] = 1
    p_pos = batch.position_ids[:, :P]
    r_pos = p_pos[:, -1:] + 1 + torch.arange(G, dtype=p_pos.dtype).unsqueeze(0)
    return TrainBatch(
        input_ids=torch.cat([batch.input_ids[:, :P], resp], 1),
        attention_mask=torch.cat([batch.attention_mask[:, :P], mask], 1),
        position_ids=torch.cat([p_pos, r_pos], 1),
        responses=resp, response_mask=mask, uid=batch.uid,
    )
