"""DAPO dynamic sampling in the driver: rounds of generation merged into one batch exactly as one
generation of the kept prompts would have built it; the trainer's rounds, limit and metric errors;
the overlong penalty and on_error=mask in the reward phase. Real dataset, tokenizer, batch assembly
and RewardManager; only the engine round trip is replaced by prepared answers."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from mrl.config import load_config
from mrl.config.run_plan import plan_run
from mrl.data.dataset import PromptDataset
from mrl.data.sampler import sampler_for
from mrl.driver.batch import assemble_train_batch, repeat_prompts
from mrl.driver.dynamic_sampling import merge_rounds, unique_uids
from mrl.driver.trainer import RLTrainer, StepData
from mrl.rewards import RewardManager
from mrl.rewards.manager import place_on_last_token
from mrl.rollout.types import RolloutResult, RolloutSample
from tests.helpers.tiny_tokenizer import save_tiny_tokenizer

N = 2
QUESTIONS = ["what is 1 + 1 ?", "what is 2 + 2 ?", "what is 3 + 3 ?", "what is 4 + 4 ?", "what is 5 + 5 ?",
             "what is 6 + 6 ?"]


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds")
    save_tiny_tokenizer(d / "tok")
    rows = [{"prompt": q, "data_source": "toy", "reward_model": {"ground_truth": "1"}} for q in QUESTIONS]
    (d / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return PromptDataset([d / "t.jsonl"], AutoTokenizer.from_pretrained(d / "tok"), max_prompt_length=16)


def _round(ds, rows: list[int], answers: list[str], lengths: list[int], pen: float = 0.0) -> StepData:
    """One scored generation round: prompts ``rows`` x N, answer texts (scored 1 when "1"), response lengths."""
    pb = ds.collate(rows)
    samples = [RolloutSample(k // N, k % N, pb.prompts[k // N].prompt_ids, list(range(10, 10 + n)), [-0.25] * n, "stop")
               for k, n in enumerate(lengths)]
    res = RolloutResult(samples, N)
    batch = assemble_train_batch(pb, res, pad_token_id=ds.pad_token_id, uids=rows)
    scores = torch.tensor([float(a == "1") for a in answers])
    return StepData(batch, repeat_prompts(pb.prompts, N), answers,
                    place_on_last_token(scores + pen, batch.response_mask), rows=rows, result=res, scores=scores,
                    valid=torch.ones(len(answers), dtype=torch.bool), reward_extra_info={"acc": scores.tolist()})


def test_merged_rounds_equal_one_generation_of_the_kept_prompts(ds) -> None:
    r1 = _round(ds, [0, 1, 2], ["1", "0", "1", "1", "0", "1"], [3, 1, 2, 2, 5, 1])  # groups 0, 2 informative
    r2 = _round(ds, [3, 4, 5], ["0", "1", "1", "1", "0", "0"], [7, 2, 1, 1, 2, 2], pen=-0.5)  # group 3 informative
    keep1, keep2 = torch.tensor([1, 1, 0, 0, 1, 1]).bool(), torch.tensor([1, 1, 0, 0, 0, 0]).bool()
    got = merge_rounds([(r1, keep1), (r2, keep2)], n=N, max_prompts=3, dataset=ds, pad_token_id=ds.pad_token_id)
    assert got["rows"] == [0, 2, 3]
    # the reference: one generation of prompts 0, 2, 3 with the same answers
    ref = _round(ds, [0, 2, 3], ["1", "0", "0", "1", "0", "1"], [3, 1, 5, 1, 7, 2])
    b, rb = got["batch"], ref.batch
    assert b.input_ids.shape[1] != r1.batch.input_ids.shape[1]  # widths differ per round: really re-assembled
    for f in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "rollout_log_probs", "uid"):
        assert torch.equal(getattr(b, f), getattr(rb, f)), f
    # token scores keep each sample's sum (round 2's carry its -0.5 penalty) on the new last token
    want = torch.tensor([1.0, 0.0, 0.0, 1.0, -0.5, 0.5])
    torch.testing.assert_close(got["token_level_scores"], place_on_last_token(want, b.response_mask), rtol=0, atol=0)
    assert got["texts"] == ["1", "0", "0", "1", "0", "1"] and got["reward_extra_info"]["acc"] == [1, 0, 0, 1, 0, 1]
    assert [p.raw_prompt for p in got["prompts"]] == [QUESTIONS[i] for i in (0, 0, 2, 2, 3, 3)]
    assert [(s.prompt_index, s.sample_index) for s in got["result"].samples] == [(i, j) for i in range(3) for j in range(N)]


def test_a_row_drawn_twice_is_two_groups() -> None:
    assert unique_uids([3, 1, 3, 3], 10) == [3, 1, 13, 23]


def scored_with_acc(solution_str: str, ground_truth: str, **kw) -> dict:
    s = float(solution_str == ground_truth)
    return {"score": s, "acc": s}


def _trainer(ds, tmp_path, rounds: list[tuple[list[int], list[str]]], *overrides: str):
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "t.jsonl").write_text("")
    cfg = load_config("mrl_configs/quickstart.yaml", [
        f"model.path={tmp_path}/m", f"data.train_files=[{tmp_path}/t.jsonl]", "rollout.n=2", "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2", "algorithm.filter_groups.enable=true",
        "data.gen_batch_size=3", "rollout.max_response_length=8", *overrides])
    plan = plan_run(cfg, "cpu", batches_per_epoch=len(ds) // 3)
    services = SimpleNamespace(train_ds=ds, pad_token_id=ds.pad_token_id, reward=RewardManager(scored_with_acc),
                               sampler=sampler_for(cfg.data, plan.gen_batch_size, ds),
                               workers=None, rm_workers=None, teacher_workers=None, ref_workers=None, pool=SimpleNamespace(asleep=False), client=None, log_dir=tmp_path,
                               plan=plan, judge=None)
    tr = RLTrainer(cfg, services)
    queue = list(rounds)

    def generate() -> StepData:  # the engine round trip: prepared answers, scored by the real reward phase
        rows, answers = queue.pop(0)
        d = _round(ds, rows, answers, [1 + k % 4 for k in range(len(answers))])
        d.token_level_scores = torch.zeros_like(d.token_level_scores)
        return d

    tr.generate = generate
    return tr


def _first_round(tr) -> StepData:
    d = tr.generate()
    tr.reward(d, {})
    return d


def test_trainer_generates_until_enough_groups_vary(ds, tmp_path) -> None:
    rounds = [([0, 1, 2], ["1", "1", "0", "0", "1", "0"]),   # only prompt 2 varies
              ([3, 4, 5], ["1", "1", "1", "0", "0", "0"])]   # prompt 4 varies
    tr = _trainer(ds, tmp_path, rounds, "algorithm.filter_groups.metric=acc")
    m: dict = {}
    d = tr.filter_groups(_first_round(tr), m)
    assert m["train/num_gen_batches"] == 2.0 and d.rows == [2, 4]
    assert d.batch.batch_size == 4 and d.batch.uid.tolist() == [2, 2, 4, 4]
    assert d.token_level_scores.sum(-1).tolist() == [1.0, 0.0, 1.0, 0.0]


def test_round_limit_and_missing_acc_are_errors(ds, tmp_path) -> None:
    same = ([0, 1, 2], ["1", "1", "0", "0", "1", "1"])
    tr = _trainer(ds, tmp_path, [same, same], "algorithm.filter_groups.metric=score",
                  "algorithm.filter_groups.max_num_gen_batches=2")
    with pytest.raises(RuntimeError, match="kept 0 of the 2 prompts.*max_num_gen_batches=2 rounds"):
        tr.filter_groups(_first_round(tr), {})
    tr = _trainer(ds, tmp_path, [same], "algorithm.filter_groups.metric=acc")
    d = _first_round(tr)
    d.reward_extra_info = {}  # as from a scorer that returns a number
    with pytest.raises(RuntimeError, match="metric=acc but reward.function=arith returned no 'acc'.*metric=score"):
        tr.filter_groups(d, {})


def test_overlong_penalty_is_added_to_the_scores(ds, tmp_path) -> None:
    tr = _trainer(ds, tmp_path, [], "algorithm.filter_groups.metric=score", "reward.overlong_buffer.enable=true",
                  "reward.overlong_buffer.len=4", "reward.overlong_buffer.penalty_factor=1.0")
    d = _round(ds, [0, 1, 2], ["1"] * 6, [1, 5, 6, 7, 8, 8])
    tr.reward(d, {})  # max 8, buffer 4: free up to 4 tokens, then -1/4 per token
    torch.testing.assert_close(d.token_level_scores.sum(-1), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0, 0.0]))
    assert d.scores.tolist() == [1.0] * 6  # the scorer's own score is kept apart (filter metric "score")


def test_on_error_mask_drops_the_sample_from_loss_and_baseline(ds, tmp_path) -> None:
    tr = _trainer(ds, tmp_path, [([0, 1, 2], ["1", "0", "1", "1", "0", "0"])], "algorithm.filter_groups.metric=score")

    def flaky(solution_str: str, ground_truth: str, **kw) -> float:
        if solution_str == "0":
            raise ValueError("scorer broke")
        return 1.0

    tr.s.reward = RewardManager(flaky, on_error="mask")
    d = tr.generate()
    m: dict = {}
    tr.reward(d, m)
    assert m["reward/masked_samples"] == 3.0 and d.valid.tolist() == [True, False, True, True, False, False]
    assert d.batch.response_mask[~d.valid].sum() == 0 and d.batch.response_mask[d.valid].sum() > 0
    assert d.batch.uid.tolist() == [0, -2, 1, 1, -5, -6]  # the failed samples are groups of their own
