"""Pure phase helpers: prompts + rollout result -> TrainBatch (padding, masks, positions, uids)."""
from __future__ import annotations

import pytest
import torch

from mrl.data.dataset import Prompt, PromptBatch
from mrl.data.tokenize import left_pad, position_ids_from_mask
from mrl.driver.batch import assemble_train_batch, repeat_prompts
from mrl.rollout.types import FINISH_ERROR, RolloutResult, RolloutSample


def _prompts(seqs: list[list[int]]) -> PromptBatch:
    ids, mask = left_pad(seqs, 0, 4)
    return PromptBatch(ids, mask, position_ids_from_mask(mask),
                       [Prompt(s, "q", str(i), "toy") for i, s in enumerate(seqs)])


def _result(prompts: list[list[int]], responses: list[list[int]], n: int) -> RolloutResult:
    samples = []
    for k, r in enumerate(responses):
        i, j = divmod(k, n)
        samples.append(RolloutSample(i, j, prompts[i], r, [-0.5] * len(r), "stop", "default"))
    return RolloutResult(samples, n)


def test_layout_masks_positions_and_uids() -> None:
    seqs = [[5, 6], [7, 8, 9]]
    res = _result(seqs, [[10], [11, 12, 13], [14, 15], [16]], n=2)
    b = assemble_train_batch(_prompts(seqs), res, pad_token_id=0, uids=[40, 41])
    assert b.input_ids.tolist() == [
        [0, 0, 5, 6, 10, 0, 0], [0, 0, 5, 6, 11, 12, 13], [0, 7, 8, 9, 14, 15, 0], [0, 7, 8, 9, 16, 0, 0]]
    assert b.attention_mask.tolist() == [
        [0, 0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 0, 0]]
    # response positions continue after the last prompt token (padding columns too, as verl)
    assert b.position_ids.tolist() == [
        [0, 0, 0, 1, 2, 3, 4], [0, 0, 0, 1, 2, 3, 4], [0, 0, 1, 2, 3, 4, 5], [0, 0, 1, 2, 3, 4, 5]]
    assert torch.equal(b.responses, b.input_ids[:, 4:])
    assert b.response_mask.tolist() == [[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]]
    assert b.uid.tolist() == [40, 40, 41, 41]
    assert b.rollout_log_probs.tolist() == [[-0.5, 0, 0], [-0.5] * 3, [-0.5, -0.5, 0], [-0.5, 0, 0]]


def test_failed_sample_has_empty_mask() -> None:
    seqs = [[5]]
    res = _result(seqs, [[10, 11], []], n=2)
    res.samples[1] = RolloutSample(0, 1, seqs[0], [], [], FINISH_ERROR, error="boom")
    b = assemble_train_batch(_prompts(seqs), res, pad_token_id=0, uids=[0])
    assert b.response_mask[1].sum().item() == 0
    assert b.attention_mask[1].tolist() == [0, 0, 0, 1, 0, 0]


def test_sample_count_and_order_are_checked() -> None:
    seqs = [[5], [6]]
    with pytest.raises(ValueError, match="3 samples for 2 prompts"):
        res = _result(seqs, [[1], [2]], n=1)
        res.samples.append(RolloutSample(1, 1, seqs[1], [3], [-0.5], "stop"))
        assemble_train_batch(_prompts(seqs), res, pad_token_id=0, uids=[0, 1])
    res = _result(seqs, [[1], [2]], n=1)
    res.samples.reverse()
    with pytest.raises(ValueError, match="order"):
        assemble_train_batch(_prompts(seqs), res, pad_token_id=0, uids=[0, 1])


def test_repeat_prompts() -> None:
    assert repeat_prompts(["a", "b"], 2) == ["a", "a", "b", "b"]
