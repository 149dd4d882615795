"""Pure helpers of the RL step: prompts + rollout result -> TrainBatch (verl's layout).

No Ray, no Megatron: these are where padding/mask bugs hide, so they are unit-tested alone.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from mrl.data.dataset import Prompt, PromptBatch
from mrl.rollout.types import RolloutResult
from mrl.workers.batch import TrainBatch


def assemble_train_batch(prompts: PromptBatch, result: RolloutResult, *, pad_token_id: int,
                         uids: Sequence[int], routed_experts: bool = False,
                         multi_modal: Sequence[dict[str, torch.Tensor]] | None = None) -> TrainBatch:
    """One TrainBatch of the B = P·n samples of ``result`` (sample k = prompt k // n, verl's interleave).

    ``prompts``: P prompts, left-padded ``input_ids``/``attention_mask``/``position_ids`` [P, Lp].
    Output: ``input_ids = [prompt (left-padded, Lp) | response (right-padded, R)]`` [B, Lp+R],
    ``attention_mask`` = prompt mask ‖ response tokens, ``position_ids`` = the prompt's positions then
    ``last_prompt_pos + 1 + t`` for response column t (padding columns too, as verl), ``responses``
    [B, R], ``response_mask`` [B, R] (1 on engine-sampled tokens, 0 on a multi-turn sample's tool/template
    tokens, which the model reads but the loss skips; a failed sample is all 0),
    ``rollout_log_probs`` [B, R] (0 on padding), ``uid`` [B] (``uids`` per prompt, repeated n times);
    with ``routed_experts`` (MoE routing replay) the engine's expert ids of every token, [B, Lp+R, layers, k]
    aligned with ``input_ids`` (-1 where the engine ran none: padding, each response's last token);
    ``multi_modal`` (vision-language prompts, mrl/driver/vision.py): per prompt its pictures' processor output,
    shared by its n samples (``TrainBatch.multi_modal``).
    """
    n = result.n
    P = prompts.input_ids.shape[0]
    if len(result.samples) != P * n:
        raise ValueError(f"rollout returned {len(result.samples)} samples for {P} prompts x n={n}")
    if len(uids) != P:
        raise ValueError(f"{len(uids)} uids for {P} prompts")
    if multi_modal is not None and len(multi_modal) != P:
        raise ValueError(f"{len(multi_modal)} multi_modal entries for {P} prompts")
    order = [s.prompt_index * n + s.sample_index for s in result.samples]
    if order != list(range(P * n)):
        raise ValueError("rollout samples are not in (prompt, sample) order")
    padded = result.to_padded(pad_token_id)
    responses, resp_mask = padded["responses"], padded["response_mask"]
    R = responses.shape[1]
    idx = torch.arange(P).repeat_interleave(n)
    p_ids, p_mask, p_pos = prompts.input_ids[idx], prompts.attention_mask[idx], prompts.position_ids[idx]
    last = p_pos[:, -1:]  # left padding: the last column is the last prompt token
    r_pos = last + 1 + torch.arange(R).unsqueeze(0)
    return TrainBatch(
        input_ids=torch.cat([p_ids, responses], dim=1),
        attention_mask=torch.cat([p_mask, padded["response_attention"]], dim=1),
        position_ids=torch.cat([p_pos, r_pos], dim=1),
        responses=responses,
        response_mask=resp_mask,
        rollout_log_probs=padded["rollout_log_probs"],
        uid=torch.as_tensor(list(uids), dtype=torch.long).repeat_interleave(n),
        routed_experts=result.routed_experts_padded(prompts.input_ids.shape[1]).long() if routed_experts else None,
        multi_modal=None if multi_modal is None else [multi_modal[k] for k in idx.tolist()],
    )


def repeat_prompts(prompts: Sequence[Prompt], n: int) -> list[Prompt]:
    """[p0, p0, ..., p1, ...]: each prompt n times in a row (the sample order of the rollout)."""
    return [p for p in prompts for _ in range(n)]


def with_agent_info(prompts: Sequence[Prompt], result: RolloutResult) -> list[Prompt]:
    """The B per-sample prompts with a multi-turn sample's agent record (turns, tool calls, final
    answer: mrl/agent/loop.py) as ``extra_info["agent"]``, which the reward function reads; prompts of
    single-turn samples are returned as they are."""
    records = [getattr(s, "agent", None) for s in result.samples]  # records of single-turn clients lack it
    if all(r is None for r in records):
        return list(prompts)
    return [p if r is None else dataclasses.replace(p, extra_info={**(p.extra_info or {}), "agent": r})
            for p, r in zip(prompts, records, strict=True)]


def tools_kwargs_of(prompts: Sequence[Prompt]) -> list[dict | None] | None:
    """Per prompt, its row's ``extra_info.tools_kwargs`` (verl's multi-turn rows; the agent loop binds
    them to that row's tool calls); None when no prompt has any."""
    kw = [(p.extra_info or {}).get("tools_kwargs") for p in prompts]
    return kw if any(k is not None for k in kw) else None


def decode_responses(tokenizer, result: RolloutResult) -> list[str]:
    """Response texts for the scorer (special tokens such as EOS dropped)."""
    return [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in result.samples]


def mask_out_samples(batch: TrainBatch, drop: torch.Tensor) -> TrainBatch:
    """``drop`` [B] bool: those samples' ``response_mask`` rows become 0 (no loss, no metrics) and each
    gets a uid of its own (negative, unused by datasets), so group baselines ignore it."""
    uid = batch.uid.clone()
    rows = torch.nonzero(drop).squeeze(1)
    uid[rows] = -1 - rows
    return batch.replace(response_mask=batch.response_mask * (~drop).to(batch.response_mask.dtype)[:, None], uid=uid)
