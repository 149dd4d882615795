"""A separate reward model (reward_model.placement=separate) as the driver builds it: its own Ray worker
group (mrl/driver/side_ranks.py -> SideModelRank), torch.distributed world (gloo, its own master port) and
Megatron layout, next to the actor's ranks at another layout (TP1 x DP2). Its scores, read through the
typed proxy, equal transformers' *ForSequenceClassification on each unpadded sequence within 1e-5
(fp32, CPU), on every rank: a Llama RM at TP2 and a Qwen2 RM at TP1 x PP2; the actor's ranks still run
their own forward afterwards (the worlds never met)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.multirank, pytest.mark.timeout(900)]
pytest.importorskip("ray")


def _config(tmp: Path, actor: Path, rm: Path, tp: int, pp: int):
    from mrl.config import check_config, load_config

    (tmp / "train.jsonl").write_text('{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}\n')
    cfg = load_config(None, [
        "cluster.device=cpu", "cluster.n_gpus_per_node=4", f"model.path={actor}", "model.dtype=float32",
        "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2", "rollout.n=2", "data.train_batch_size=2",
        f"data.train_files=[{tmp / 'train.jsonl'}]", "data.max_prompt_length=16", "rollout.max_response_length=8",
        "reward_model.enable=true", f"reward_model.model.path={rm}", "reward_model.micro_batch_size_per_gpu=3",
        "reward_model.placement=separate", "reward_model.num_devices=2",
        f"reward_model.megatron.tensor_model_parallel_size={tp}", f"reward_model.megatron.pipeline_model_parallel_size={pp}"])
    assert check_config(cfg)[0] == []
    return cfg


def test_separate_rm_group_matches_transformers_next_to_the_actor(tmp_path: Path) -> None:
    import ray

    from mrl.cluster import WorkerGroup, init_ray
    from mrl.config.run_plan import plan_run
    from mrl.driver.ranks import TrainRanks
    from mrl.driver.side_ranks import SideModelRanks, start_side_group
    from tests.helpers.tiny_models import make_tiny_hf
    from tests.workers.batches import ragged_batch
    from tests.workers.test_reward_model import _hf_scores, make_tiny_rm

    actor = make_tiny_hf(tmp_path / "actor", "qwen2")
    rms = {family: make_tiny_rm(tmp_path / f"rm_{family}", family) for family in ("llama", "qwen2")}
    batch = ragged_batch()
    init_ray(None, num_cpus=4)  # 2 actor ranks + 2 RM ranks
    groups: list[WorkerGroup] = []
    try:
        cfg = _config(tmp_path, actor, rms["llama"], 2, 1)
        plan = plan_run(cfg, "cpu")
        assert (plan.trainer_ranks, plan.reward_model_ranks) == (2, 2)
        groups.append(WorkerGroup("mrl.workers.rank.TrainRank", {"cfg": cfg, "plan": plan}, world_size=2, device="cpu",
                                  extra_env={"OMP_NUM_THREADS": "1"}, timeout_s=600))
        actor_ranks = TrainRanks(groups[0])
        for family, tp, pp in (("llama", 2, 1), ("qwen2", 1, 2)):
            rm = rms[family]
            cfg = _config(tmp_path, actor, rm, tp, pp)
            group = start_side_group(cfg, plan_run(cfg, "cpu"), "reward_model")
            group.wait_constructed()
            groups.append(group)
            one, _ = _hf_scores(rm)
            assert float(one.std()) > 0.05  # scores differ between samples: the comparison means something
            got = SideModelRanks(group).compute_side("reward_model", batch)
            torch.testing.assert_close(got, one, rtol=0, atol=1e-5, msg=f"{family} TP{tp}xPP{pp}")
            for r, s in enumerate(group.execute_all("compute_side", "reward_model", batch)):  # every rank: the full [B]
                torch.testing.assert_close(s, one, rtol=0, atol=1e-5, msg=f"{family} TP{tp}xPP{pp} rank {r}")
            print(f"{family} TP{tp}xPP{pp}: max |mrl - HF| = {float((got - one).abs().max()):.2e}")
            group.close("close", timeout_s=60)  # the next layout gets the two CPUs
            groups.pop()
        log_probs, _ = actor_ranks.compute_log_prob(batch)  # the actor's own world and layout are intact
        assert log_probs.shape == batch.response_mask.shape and bool(torch.isfinite(log_probs).all())
    finally:
        for g in groups:
            g.shutdown()
        ray.shutdown()
