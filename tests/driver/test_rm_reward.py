"""The driver's side of phase rm_score: re-rendering for an RM with its own tokenizer (verl's
_switch_chat_template) and the combination of RM and rule scores (reward_model.combine)."""
from __future__ import annotations

import pytest
import torch

from mrl.driver.rm_reward import (
    RewardModelInputs,
    combine_rm,
    rm_input_batch,
    rm_rule_agreement,
    rm_rule_metrics,
    rm_texts,
)
from tests.helpers.tiny_tokenizer import (
    CHATML_TEMPLATE,
    add_chat_template,
    save_other_tokenizer,
    save_tiny_tokenizer,
)
from tests.workers.test_reward_model import actor_batch


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("toks")
    save_tiny_tokenizer(tmp / "actor")
    add_chat_template(tmp / "actor", CHATML_TEMPLATE)
    save_other_tokenizer(tmp / "rm")
    return AutoTokenizer.from_pretrained(tmp / "actor"), AutoTokenizer.from_pretrained(tmp / "rm")


def test_responses_are_decoded_and_rerendered_with_the_rm_template(toks) -> None:
    actor, rm = toks
    batch, prompts = actor_batch(actor)
    texts = rm_texts(batch, prompts, actor, rm)
    # a chat prompt keeps its messages; the actor's EOS (</s>) is removed from the response text
    assert texts[0] == ("<|im_start|>system\nadd<|im_end|>\n<|im_start|>user\nwhat is 3 + 4 ?<|im_end|>\n"
                        "<|im_start|>assistant\n 7<|im_end|>\n")
    # a plain-text prompt becomes one user message
    assert texts[1] == ("<|im_start|>user\nquestion: what is 12 + 30 ? answer:<|im_end|>\n"
                        "<|im_start|>assistant\n 42 because 12 + 30 = 42<|im_end|>\n")
    with pytest.raises(ValueError, match="6 prompts for a batch of 7"):
        rm_texts(batch, prompts[:6], actor, rm)


def test_rm_batch_is_right_padded_and_cut_at_max_length(toks) -> None:
    actor, rm = toks
    batch, prompts = actor_batch(actor)
    out = rm_input_batch(batch, prompts, actor, rm)
    n = out.attention_mask.sum(-1)
    for i, t in enumerate(rm_texts(batch, prompts, actor, rm)):
        ids = rm(t, add_special_tokens=False)["input_ids"]
        assert out.input_ids[i, : n[i]].tolist() == ids and int(n[i]) == len(ids)
        assert bool((out.input_ids[i, n[i]:] == rm.pad_token_id).all()) and bool((out.attention_mask[i, n[i]:] == 0).all())
        assert out.position_ids[i, : n[i]].tolist() == list(range(len(ids)))
    assert int(n.max()) > batch.input_ids.shape[1]  # longer than the actor's batch (no merges): not cut by default
    assert out.responses.shape == (7, 0) and out.prompt_length == out.input_ids.shape[1]  # one sequence per row
    cut = rm_input_batch(batch, prompts, actor, rm, max_length=20)
    assert cut.input_ids.shape == (7, 20) and cut.input_ids.tolist() == out.input_ids[:, :20].tolist()
    # shared tokenizer: the actor's batch as it is
    assert RewardModelInputs(actor)(batch, prompts) is batch
    assert RewardModelInputs(actor, rm, 20)(batch, prompts).input_ids.tolist() == cut.input_ids.tolist()


def _rule(calls: list):
    from mrl.rewards import RewardManager

    def score(solution_str, ground_truth, data_source=None, extra_info=None):
        calls.append(extra_info)
        return 1.0 if solution_str.strip() == ground_truth else 0.0

    mgr = RewardManager(score)
    return lambda extra: mgr([" 7", " 8", " 9"], ["7", "7", "9"], data_sources=["a"] * 3, extra_infos=extra)


@pytest.mark.parametrize("combine,expected,called", [
    ("rm", [0.5, -1.0, 2.0], False),            # verl's default: the RM score is the reward
    ("rule+rm", [1.5, -1.0, 3.0], True),        # the rule's 1/0/1 plus the RM score
    ("function", [1.0, 0.0, 1.0], True),        # the function alone (it sees extra_info['rm_score'])
])
def test_combine_modes(combine: str, expected: list[float], called: bool) -> None:
    calls: list = []
    rm = torch.tensor([0.5, -1.0, 2.0])
    out = combine_rm(combine, rm, _rule(calls), [{"index": 0}, None, {"index": 2}])
    assert out.scores.tolist() == expected and bool(out.valid.all())
    if called:
        assert calls == [{"index": 0, "rm_score": 0.5}, {"rm_score": -1.0}, {"index": 2, "rm_score": 2.0}]
    else:
        assert calls == [] and out.errors == [None] * 3



def test_rm_rule_agreement_counts_the_answers_the_rm_is_fooled_by() -> None:
    # RM verdicts (score > 0): right, right, wrong, wrong, right; rule: right, wrong, wrong, right, failed (None)
    rm = torch.tensor([2.0, 0.3, -1.0, -0.1, 5.0])
    per = rm_rule_agreement(rm, [1.0, 0.0, 0.0, 1.0, None])
    sig = torch.sigmoid(rm).tolist()
    assert per["agree"] == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert per["fooled"] == [0.0, 1.0, 0.0, 0.0, 1.0]
    assert per["wrong_prob"] == pytest.approx([0.0, sig[1], sig[2], 0.0, sig[4]])
    m = rm_rule_metrics(rm, {"acc": [1.0, 0.0, 0.0, 1.0, None], "score": [0.0] * 5})
    assert m == pytest.approx({"reward/rm_rule_agreement": 0.4, "reward/rm_fooled": 0.4,
                               "reward/rm_prob_wrong": (sig[1] + sig[2] + sig[4]) / 3})


def test_rm_prob_wrong_sees_gaming_below_the_verdict_threshold() -> None:
    # every verdict still "wrong" (agreement 1), but the wrong answers earn σ = 0.45 instead of 0.01
    honest = rm_rule_metrics(torch.full((4,), -4.6), {"acc": [0.0] * 4})
    gamed = rm_rule_metrics(torch.full((4,), -0.2), {"acc": [0.0] * 4})
    assert honest["reward/rm_rule_agreement"] == gamed["reward/rm_rule_agreement"] == 1.0
    assert honest["reward/rm_prob_wrong"] < 0.02 and gamed["reward/rm_prob_wrong"] > 0.4
    assert rm_rule_metrics(torch.tensor([3.0]), {"acc": [1.0]})["reward/rm_prob_wrong"] == 0.0  # none wrong


def test_rm_rule_metrics_need_a_rule_verdict() -> None:
    assert rm_rule_metrics(torch.tensor([1.0]), {"score": [1.0]}) == {}
    assert rm_rule_metrics(torch.tensor([1.0]), {}) == {}
    with pytest.raises(ValueError, match="2 RM scores for 1 rule verdicts"):
        rm_rule_agreement(torch.tensor([1.0, 2.0]), [1.0])
