"""`mrl train` with a generative judge: the quickstart for 2 steps where the judge (an embedded engine of
its own, started next to the rollout engines) writes the only reward, validated before step 1 with the
judge too; the arith rule is only reported (rule_score, acc). The judge is the random quickstart model, whose
greedy answer repeats the last token of its prompt (after "verdict:" it writes "::::::", so no verdict would ever
parse): the template here ends with the ground truth, so the answer is its last digit six times, and the pattern
reads 0-4 only. Verdicts of sums ending in 0-4 parse (reward = that digit), the others do not (reward.on_error=zero:
counted, zeroed). The seeded sampler's (data.seed) first two batches hold both kinds, 4 prompts each, whatever
the actor writes, so both the reward = verdict check and the zeroing check run on every run."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.e2e import free_port_pair, metrics, run_train, write_assets

pytestmark = pytest.mark.slow


def test_judge_rewards_two_steps(tmp_path: Path) -> None:
    assets = write_assets(tmp_path)
    B = 8 * 4
    p = run_train("mrl_configs/quickstart_judge.yaml", tmp_path, assets, free_port_pair(),
                  f"data.val_files=[{assets}/data/val.jsonl]", "trainer.total_training_steps=2",
                  "trainer.test_freq=-1", "trainer.val_before_train=true", "trainer.save_freq=-1",
                  "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4",
                  "actor.ppo_micro_batch_size_per_gpu=4",
                  f"reward.judge.model={assets}/tiny-qwen2", f"reward.judge.port_base={free_port_pair()}",
                  "reward.judge.prompt_template='{prompt}{response} ? verdict: {ground_truth}'",
                  "reward.judge.parse.pattern='([0-4])'", "reward.judge.parse.scores=null", "reward.on_error=zero")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    db = tmp_path / "mlflow.db"
    unparsed, failed = metrics(db, "reward/judge_unparsed"), metrics(db, "reward/judge_errors")
    zeroed, score, judged = metrics(db, "reward/zeroed_samples"), metrics(db, "critic/score/mean"), \
        metrics(db, "reward/judge_score")
    assert sorted(unparsed) == sorted(failed) == sorted(zeroed) == [1, 2]
    for s in (1, 2):
        assert failed[s] == 0 and zeroed[s] == unparsed[s]  # every unparsable verdict counted and zeroed
        # some verdicts parse and some do not (module doc): neither check below can pass vacuously
        assert 0 < unparsed[s] < B, f"step {s}: {unparsed[s]:g} of {B} verdicts unparsed (module doc)"
        assert 0 <= judged[s] <= 4, judged
        # the reward is the judge's digit, 0 for the unparsed samples
        assert abs(score[s] * B - judged[s] * (B - unparsed[s])) < 1e-3, (score, judged, unparsed)
    assert all(v > 0 for v in metrics(db, "timing_s/judge").values())
    assert sorted(metrics(db, "reward/rule_score")) == [1, 2]
    assert all(0 <= v <= 1 for v in metrics(db, "val-aux/arith/judge_rule_agreement/mean_at_1").values())
    # validation is judged too: the judge's score is the reward, the rule only reported as acc
    assert list(metrics(db, "val-aux/arith/judge_score/mean_at_1")) == [0]
    assert list(metrics(db, "val-core/arith/acc/mean_at_1")) == [0]
    assert sorted(metrics(db, "actor/pg_loss")) == [1, 2]
