"""`mrl train` with a model-based reward: the quickstart for 2 steps scored by a reward model only
(reward_model.combine=rm, validated before step 1 with the RM too), by rule + RM, by a function reading
the RM score, and by an RM with its own tokenizer and chat template (reward_model.model.input_tokenizer:
responses re-rendered), the RM colocated on the actor's ranks (phase rm_score); and a separate RM
(reward_model.placement=separate: ranks, world and TP layout of its own) scoring as the colocated one."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.e2e import free_port_pair, metrics, run_train, write_assets

pytestmark = pytest.mark.slow


def make_rm_from(lm_path: Path, out: Path, seed: int = 0) -> Path:
    """A Qwen2ForSequenceClassification with the quickstart model's body and a random score head."""
    import transformers as tf

    torch.manual_seed(seed)
    rm = tf.AutoModelForSequenceClassification.from_pretrained(lm_path, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        rm.score.weight.normal_(0.0, 1.0)
    rm.save_pretrained(out, safe_serialization=True)
    return out


@pytest.mark.parametrize("combine", ["rule+rm", "function", "rm-own-tokenizer"])  # "rm": the colocated run below
def test_reward_model_rewards_two_steps(tmp_path: Path, combine: str) -> None:
    assets = write_assets(tmp_path)
    fn = tmp_path / "uses_rm.py"  # combine=function: a custom scorer reads the RM score from extra_info
    fn.write_text("def compute_score(solution_str, ground_truth, data_source=None, extra_info=None):\n"
                  "    return 2.0 * extra_info['rm_score']\n")
    rm = make_rm_from(assets / "tiny-qwen2", tmp_path / "rm")
    extra = []
    if combine == "rm-own-tokenizer":  # another tokenizer (bytes only, ChatML template) over the same body
        from tests.helpers.tiny_tokenizer import save_other_tokenizer

        save_other_tokenizer(rm)
        combine, extra = "rm", [f"reward_model.model.input_tokenizer={assets}/tiny-qwen2"]
    p = run_train("mrl_configs/quickstart.yaml", tmp_path, assets, free_port_pair(),
                  f"data.val_files=[{assets}/data/val.jsonl]", "trainer.total_training_steps=2",
                  "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
                  "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4",
                  "actor.ppo_micro_batch_size_per_gpu=4",
                  "reward_model.enable=true", f"reward_model.model.path={rm}", "reward_model.micro_batch_size_per_gpu=4",
                  f"reward_model.combine={combine}", *([f"reward.function={fn}:compute_score"] if combine == "function" else []),
                  *extra)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    _check_two_rewarded_steps(tmp_path / "mlflow.db", combine, validated=False)


def _check_two_rewarded_steps(db: Path, combine: str, validated: bool) -> None:
    """Steps 1 and 2 of a run with ``reward_model.combine=combine`` (and validation before step 1 if ``validated``)."""
    mean, lo, hi = (metrics(db, f"critic/rm_score/{s}") for s in ("mean", "min", "max"))
    assert sorted(mean) == sorted(lo) == sorted(hi) == [1, 2]
    assert all(lo[s] <= mean[s] <= hi[s] and lo[s] < hi[s] for s in (1, 2))  # a real, varying score
    score = metrics(db, "critic/score/mean")
    if combine == "rm":  # the training reward is the RM score (verl's reward manager returns rm_scores)
        assert all(abs(score[s] - mean[s]) < 1e-5 for s in (1, 2)), (score, mean)
        if validated:  # validation: the RM score is the reward
            val, val_rm = metrics(db, "val-core/arith/reward/mean_at_1"), metrics(db, "val-aux/arith/rm_score/mean_at_1")
            assert list(val) == list(val_rm) == [0] and abs(val[0] - val_rm[0]) < 1e-6, (val, val_rm)
    elif combine == "function":  # the custom scorer's 2 * extra_info["rm_score"]
        assert all(abs(score[s] - 2 * mean[s]) < 1e-4 for s in (1, 2)), (score, mean)
    else:  # plus the arith rule's 0/1 score: its batch mean lies in [0, 1]
        assert all(-1e-5 <= score[s] - mean[s] <= 1 + 1e-5 for s in (1, 2)), (score, mean)
    assert all(v > 0 for v in metrics(db, "timing_s/rm_score").values())
    assert sorted(metrics(db, "actor/pg_loss")) == [1, 2]


def test_separate_reward_model_scores_as_the_colocated_one(tmp_path: Path) -> None:
    """reward_model.placement=separate (2 more CPU ranks: its own group, world and layout, TP2; the actor
    stays TP1 x DP2 on 2): the same seed samples the same answers before the first update, so validation
    (step 0) and step 1 score the same sequences; the RM's scores agree with the colocated run's to 1e-5
    (a TP2 vs TP1 forward differs only in summation order). Step 2 trains on them end to end. The colocated
    run is the reward_model.combine=rm case (validated before step 1 with the RM too)."""
    assets = write_assets(tmp_path)
    rm = make_rm_from(assets / "tiny-qwen2", tmp_path / "rm")
    common = [f"data.val_files=[{assets}/data/val.jsonl]", "trainer.test_freq=-1", "trainer.val_before_train=true",
              "trainer.save_freq=-1", "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4",
              "actor.ppo_micro_batch_size_per_gpu=4", "reward_model.enable=true", f"reward_model.model.path={rm}",
              "reward_model.micro_batch_size_per_gpu=4", "reward_model.combine=rm"]
    runs = {}
    # the colocated run is also the reward_model.combine=rm case of the test above (its steps 1-2 are checked
    # as those of the other combines); the separate one is compared with it on validation and step 1
    for name, extra in (("colocated", ["trainer.total_training_steps=2"]),
                        ("separate", ["trainer.total_training_steps=2", "cluster.n_gpus_per_node=4",
                                      "reward_model.placement=separate", "reward_model.num_devices=2",
                                      "reward_model.megatron.tensor_model_parallel_size=2"])):
        out = tmp_path / name
        out.mkdir()
        p = run_train("mrl_configs/quickstart.yaml", out, assets, free_port_pair(), *common, *extra,
                      f"trainer.default_local_dir={out}/ckpt")
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
        runs[name] = out / "mlflow.db"
    col, sep = runs["colocated"], runs["separate"]
    _check_two_rewarded_steps(col, "rm", validated=True)
    mean = metrics(sep, "critic/rm_score/mean")
    assert sorted(mean) == [1, 2] and sorted(metrics(sep, "actor/pg_loss")) == [1, 2]
    for key in ("critic/rm_score/mean", "critic/rm_score/min", "critic/rm_score/max", "critic/score/mean"):
        a, b = metrics(col, key)[1], metrics(sep, key)[1]
        assert abs(a - b) < 1e-5, (key, a, b)
    lo, hi = metrics(sep, "critic/rm_score/min"), metrics(sep, "critic/rm_score/max")
    assert all(lo[s] < hi[s] for s in (1, 2))  # a real, varying score
    for key in ("val-aux/arith/rm_score/mean_at_1", "val-core/arith/reward/mean_at_1"):
        a, b = metrics(col, key), metrics(sep, key)
        assert list(a) == list(b) == [0] and abs(a[0] - b[0]) < 1e-5, (key, a, b)
    assert all(v > 0 for v in metrics(sep, "timing_s/rm_score").values())
    print(f"step 1 critic/rm_score/mean: colocated {metrics(col, 'critic/rm_score/mean')[1]:.7f}, "
          f"separate {mean[1]:.7f}")
