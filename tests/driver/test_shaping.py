"""Driver-side reward shaping (docs/driver.md) with plain tensors: weights, blend, entropy gate, gold batch."""
from __future__ import annotations

import pytest
import torch

from mrl.config.algorithm import RefAlignmentConfig, RefRewardBlendConfig
from mrl.data.dataset import Prompt
from mrl.driver.shaping import (
    batch_mean_entropy,
    build_gold_batch,
    check_gold_answers,
    encode_gold,
    ref_blend,
    repr_align,
)
from mrl.workers.batch import TrainBatch
from mrl.workers.minibatch import build_model_inputs

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])


def test_blend_weight_follows_the_schedule_and_mixes_masked_minmax() -> None:
    cfg = RefRewardBlendConfig(enable=True, max_weight=0.6, warmup_ratio=0.5, schedule="linear")
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    ref = torch.tensor([[-3.0, -1.0, -2.0, 99.0], [-5.0, -4.0, 7.0, 7.0]])  # 99/7 on padding must not count
    weights = {}
    for step in (0, 2, 5, 9):  # 10 steps, warm-up 5: w = 0.6 * min(step / 5, 1)
        m: dict[str, float] = {}
        out = ref_blend(cfg, r, ref, MASK, step=step, total_steps=10, metrics=m)
        weights[step] = m["actor/ref_blend/weight"]
    assert weights == pytest.approx({0: 0.0, 2: 0.24, 5: 0.6, 9: 0.6}, abs=1e-12)
    w = 0.6
    norm = torch.tensor([[0.0, 1.0, 0.5, 0.0], [0.0, 1.0, 0.0, 0.0]])
    torch.testing.assert_close(out, (1 - w) * r + w * norm, rtol=0, atol=1e-6)
    assert torch.all(out[MASK == 0] == 0)


def test_blend_without_ref_log_prob_names_the_key() -> None:
    with pytest.raises(RuntimeError, match="algorithm.ref_reward_blend.enable"):
        ref_blend(RefRewardBlendConfig(enable=True), torch.zeros(2, 4), None, MASK, step=0, total_steps=4, metrics={})


def test_batch_mean_entropy_is_masked() -> None:
    ent = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, 100.0, 100.0]])
    assert batch_mean_entropy(ent, MASK) == pytest.approx(3.0)


def _align(threshold: float, ent_value: float):
    cfg = RefAlignmentConfig(max_weight=0.2, warmup_ratio=0.5, schedule="linear", entropy_high_threshold=threshold)
    calls = []

    def sim():
        calls.append(1)
        return torch.tensor([0.5, -1.0])

    r = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    m: dict[str, float] = {}
    out = repr_align(cfg, r, MASK, torch.full((2, 4), ent_value), step=3, total_steps=4, similarity=sim, metrics=m)
    return r, out, m, calls


def test_repr_align_applies_when_entropy_is_high() -> None:
    r, out, m, calls = _align(threshold=1.0, ent_value=1.0)  # >= threshold: applied
    assert calls == [1]
    assert m["actor/repr/ref_gold_align/weight"] == pytest.approx(0.2)  # step 3 >= warm-up 2
    assert m["actor/repr/ref_gold_align/applied"] == 1.0
    assert m["actor/repr/ref_gold_align/similarity/mean"] == pytest.approx(-0.25)
    bonus = out - r
    # w * sim / |mask| on each valid token, 0 on padding; sums to w * sim per sequence
    torch.testing.assert_close(bonus[0], torch.tensor([0.1 / 3] * 3 + [0.0]), rtol=0, atol=1e-7)
    torch.testing.assert_close(bonus[1], torch.tensor([-0.1, -0.1, 0.0, 0.0]), rtol=0, atol=1e-7)


def test_repr_align_skips_when_entropy_is_low() -> None:
    r, out, m, calls = _align(threshold=1.0, ent_value=0.999)
    assert calls == []  # no reference forward when the gate is closed
    assert out is r
    assert m["actor/repr/ref_gold_align/applied"] == 0.0
    assert m["actor/repr/ref_gold_align/weight"] == pytest.approx(0.2)  # still logged
    assert m["actor/repr/ref_gold_align/batch_entropy"] == pytest.approx(0.999)
    assert "actor/repr/ref_gold_align/similarity/mean" not in m


class _Tok:
    """Character-level tokenizer: 'a' -> 10, 'b' -> 11, ...; EOS 2."""

    eos_token_id = 2

    def __call__(self, text: str, add_special_tokens: bool = True):
        assert not add_special_tokens
        return {"input_ids": [ord(c) - ord("a") + 10 for c in text]}


def _prompt(gt, source="train.jsonl:7"):
    return Prompt([5], "q", gt, source=source)


def test_encode_gold_appends_eos_and_truncates() -> None:
    ids = encode_gold(_Tok(), [_prompt("ab"), _prompt(42), _prompt("abcdef")], key="reward_model.ground_truth",
                      max_length=4)
    assert ids == [[10, 11, 2], [ord("4") - 87, ord("2") - 87, 2], [10, 11, 12, 13]]


@pytest.mark.parametrize("gt", [None, "", "  ", ["a", "b"], True])
def test_missing_gold_answer_names_row_and_key(gt) -> None:
    with pytest.raises(ValueError, match=r"train.jsonl:7.*'reward_model.ground_truth'.*data.ground_truth_key"):
        check_gold_answers([_prompt("fine", "train.jsonl:1"), _prompt(gt)], "reward_model.ground_truth")


def test_gold_batch_keeps_the_prompt_and_appends_gold_tokens() -> None:
    # prompts left-padded to P=3: [pad, 7, 8] and [6, 7, 8]; generated responses R=2
    am = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    ids = torch.tensor([[0, 7, 8, 20, 0], [6, 7, 8, 21, 22]])
    pos = torch.tensor([[0, 0, 1, 2, 3], [0, 1, 2, 3, 4]])
    b = TrainBatch(input_ids=ids, attention_mask=am, position_ids=pos, responses=ids[:, 3:], response_mask=am[:, 3:],
                   uid=torch.tensor([0, 1]))
    g = build_gold_batch(b, [[30, 31, 2], [40]], pad_token_id=0)
    assert g.prompt_length == 3 and g.response_length == 3
    assert g.input_ids.tolist() == [[0, 7, 8, 30, 31, 2], [6, 7, 8, 40, 0, 0]]
    assert g.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    assert g.response_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert g.position_ids[:, 3:].tolist() == [[2, 3, 4], [3, 4, 5]]
    assert g.uid.tolist() == [0, 1]
    # the model sees prompt + gold, compacted, with contiguous positions
    mi = build_model_inputs(g)
    assert mi.tokens[0, : int(mi.num_tokens[0])].tolist() == [7, 8, 30, 31, 2]
    assert mi.position_ids[0, : int(mi.num_tokens[0])].tolist() == [0, 1, 2, 3, 4]
    # gold == generated gives the generated batch's own model inputs
    same = build_gold_batch(b, [[20], [21, 22]], pad_token_id=0)
    assert torch.equal(same.input_ids, b.input_ids) and torch.equal(same.attention_mask, b.attention_mask)
    assert torch.equal(same.position_ids, b.position_ids)
