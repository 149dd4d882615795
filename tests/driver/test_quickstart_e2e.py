"""`mrl train mrl_configs/quickstart.yaml` end to end on CPU: 2 steps, checkpoint (with its HF copy). Resuming is
tests/driver/test_reproducible_resume_e2e.py's (a resumed run equals the uninterrupted one, the engines' weight
version included).

Real components throughout: Ray rank actors with Megatron GPTModel (gloo, DP=2), two embedded
engine processes, tensor-transport weight sync, the arith scorer and an MLflow sqlite store.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.e2e import free_port_pair, metrics, run_train, write_assets

pytestmark = pytest.mark.slow


def _train(tmp: Path, assets: Path, steps: int, port: int):
    return run_train("mrl_configs/quickstart.yaml", tmp, assets, port, f"data.val_files=[{assets}/data/val.jsonl]",
                     f"trainer.total_training_steps={steps}", "trainer.save_freq=2", "trainer.test_freq=2",
                     "trainer.val_before_train=false", "rollout.weight_sync.transport=tensor",  # engine processes:
                     # the quickstart's own default (auto: inprocess) runs in test_inprocess_e2e.py
                     # joins the session's Ray: `make train`'s own local start is test_inprocess_e2e.py's
                     f"trainer.default_local_dir={tmp}/ckpt", *SMALL_BATCH, *VAL_SAMPLING, *_dumps_and_hf(tmp))


# The pipeline, not learning, is under test: 8 prompts x n=4 = 32 samples per step (the shipped 32 x 8 = 256
# is there for the learning curve), 2 optimizer steps per step (mini-batches of 4 prompts).
SMALL_BATCH = ("data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4",
               "actor.ppo_micro_batch_size_per_gpu=4")


# verl val_kwargs: 2 sampled answers per val prompt -> mean@2, best@2 (+ 3 logged generations)
VAL_SAMPLING = ("rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.n=2", "rollout.val_kwargs.temperature=1.0",
                "trainer.log_val_generations=3")


def _dumps_and_hf(tmp: Path) -> tuple[str, ...]:
    """verl's sample dumps and an HF copy of the actor in every checkpoint (actor/huggingface)."""
    return (f"trainer.rollout_data_dir={tmp}/rollouts", f"trainer.validation_data_dir={tmp}/val_dumps",
            "actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]")


def test_quickstart_trains_and_checkpoints(tmp_path: Path) -> None:
    assets = write_assets(tmp_path)
    port = free_port_pair()
    p = _train(tmp_path, assets, 2, port)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    db = tmp_path / "mlflow.db"
    score = metrics(db, "critic/score/mean")
    assert sorted(score) == [1, 2] and all(0.0 <= v <= 1.0 for v in score.values())
    assert sorted(metrics(db, "actor/pg_loss")) == [1, 2]
    # the engines sample from the actor's distribution: fp32 engine vs Megatron actor (step 2: after a
    # weight sync), probabilities equal to 4.5e-7 when measured
    diff = metrics(db, "training/rollout_probs_diff_max")
    assert sorted(diff) == [1, 2] and all(v < 1e-5 for v in diff.values()), diff
    assert all(v > 0 for v in metrics(db, "perf/throughput").values())
    mean2 = metrics(db, "val-core/arith/reward/mean_at_2")
    best2 = metrics(db, "val-core/arith/reward/best_at_2/mean")
    assert sorted(mean2) == sorted(best2) == [2] and 0.0 <= mean2[2] <= best2[2] + 0.05 <= 1.05
    assert sorted(metrics(db, "val-aux/arith/reward/worst_at_2/mean")) == [2]
    (gens,) = (tmp_path / "artifacts").rglob("val_step2.json")  # the MLflow run's artifact
    assert [sorted(r) for r in json.loads(gens.read_text())] == [["input", "output", "score"]] * 3
    # The engines themselves reported the version they generated with: start weights at step 1,
    # the version pushed after step 1 at step 2.
    assert metrics(db, "rollout/engine_weight_version") == {1: 0.0, 2: 1.0}
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    state = json.loads((ckpt / "global_step_2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["weight_version"] == 2
    assert (ckpt / "global_step_2" / "actor" / "metadata.json").is_file()
    _check_dumps_and_hf_export(tmp_path, assets, ckpt / "global_step_2" / "actor" / "huggingface")



def _check_dumps_and_hf_export(tmp: Path, assets: Path, hf_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    for step in (1, 2):  # 8 prompts x rollout.n=4 samples per step
        rows = [json.loads(x) for x in (tmp / "rollouts" / f"{step}.jsonl").read_text().rstrip("\n").split("\n")]
        assert len(rows) == 32 and all(r["step"] == step and 0.0 <= r["score"] <= 1.0 for r in rows)
        assert list(rows[0])[:5] == ["input", "output", "gts", "score", "step"]
    n_val = len((assets / "data" / "val.jsonl").read_text().splitlines())
    assert sorted(f.name for f in (tmp / "val_dumps").iterdir()) == ["2.jsonl"]  # test_freq=2, no val before train
    val = [json.loads(x) for x in (tmp / "val_dumps" / "2.jsonl").read_text().rstrip("\n").split("\n")]
    assert len(val) == 2 * n_val and all(r["reward"] == r["score"] for r in val)  # val_kwargs.n=2
    trained = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).state_dict()
    start = AutoModelForCausalLM.from_pretrained(str(assets / "tiny-qwen2"), dtype=torch.float32).state_dict()
    assert trained.keys() == start.keys() and all(trained[k].shape == start[k].shape for k in start)
    assert any(not torch.equal(trained[k], start[k]) for k in start)  # two updates moved the weights
