"""The rollout producer (mrl/driver/async_rollout.py) against a real embedded engine served in this
process: it runs at most max_staleness batches ahead of the trainer, hands batches in step order,
and a checkpoint's sampler state is the one before the oldest batch not trained yet; a push while
the producer generates (partial rollouts) aborts the samples and continues them with the new
weights; ``admit`` refuses samples older than max_staleness (by their oldest token)."""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import torch

from mrl.data.sampler import ResumableSampler
from mrl.driver.async_rollout import AsyncRollout
from mrl.driver.rollout_controller import RolloutController
from mrl.rollout.client import RolloutClient
from mrl.rollout.pool import EngineEndpoint, EnginePool
from mrl.rollout.router import Router
from mrl.rollout.types import RolloutRequest, RolloutResult, RolloutSample
from mrl.workers.batch import TrainBatch
from tests.helpers.tiny_models import make_tiny_hf
from tests.rollout.clients.served import serve


def _request(rows: list[int], step: int, epoch: int) -> tuple[list[int], RolloutRequest]:
    seeds = [[1000 * step + 10 * r + j for j in range(2)] for r in rows]
    return rows, RolloutRequest([[5, 6, 7 + r] for r in rows], n=2, sampling_params={"max_new_tokens": 4},
                                timeout_s=60, sampling_seeds=seeds)


def _wait(cond, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_producer_runs_k_ahead_in_order_and_checkpoints_the_untrained_batches(tmp_path: Path) -> None:
    with serve(tmp_path) as (url, _engine):
        pool = EnginePool([EngineEndpoint(url)], health_interval_s=0)
        try:
            ctl = RolloutController(pool, RolloutClient(Router(pool)), None, startup_timeout_s=30, log_dir=tmp_path)
            sampler = ResumableSampler(20, 2, shuffle=True, seed=3)
            expected = ResumableSampler(20, 2, shuffle=True, seed=3)
            want = [expected.next_batch() for _ in range(5)]  # the run's 5 steps
            prod = AsyncRollout(ctl, sampler, _request, max_staleness=2, partial=False, timeout_s=60)
            prod.start(step=0, version=0, end=5)
            _wait(lambda: len(prod._ready) == 3, "the producer did not fill its 3 batches")
            time.sleep(0.5)
            assert len(prod._ready) == 3  # batch 3 waits for step 1 to end (staleness <= 2)
            b0 = prod.take(0)
            assert (b0.index, b0.rows, b0.start_version) == (0, want[0], 0) and b0.continued == 0
            assert all(s.weight_version == "default" and s.response_length == 4 for s in b0.result.samples)
            resumed = ResumableSampler(20, 2, shuffle=True, seed=3)
            resumed.load_state_dict(prod.sampler_state())  # step 0 trained, batches 1 and 2 not
            assert resumed.next_batch() == want[1]
            prod.step_done(1)
            _wait(lambda: len(prod._ready) == 3, "batch 3 did not start after step 1 ended")
            assert [prod.take(s).rows for s in (1, 2, 3)] == want[1:4]
            prod.step_done(4)  # step 4 is the run's last: batch 4 comes, nothing after it
            assert prod.take(4).rows == want[4]
            prod.step_done(5)
            time.sleep(0.5)
            assert not prod._ready and not prod._generating and sampler.state_dict() == expected.state_dict()
            prod.stop()
        finally:
            pool.close()


class _DiskRanks:
    """Stands in for the trainer ranks' side of a push (the engines load version ``v`` from a saved
    model, which is what ``sync_weights`` ends in); everything around it is the producer's own push."""

    def __init__(self, pool: EnginePool, model_dir: Path) -> None:
        self.pool, self.model_dir, self.versions = pool, model_dir, []

    def sync_weights(self, version: int, pause: bool) -> list[dict[str, float]]:
        self.pool.control("/update_weights_from_disk", {"model_path": str(self.model_dir), "weight_version": str(version)})
        if pause:
            self.pool.resume()
        self.versions.append(version)
        return [{}]


def test_push_while_the_producer_generates_continues_its_samples_with_the_new_weights(tmp_path: Path) -> None:
    """What the e2e test (tests/driver/test_async_e2e.py) sees only when the push lands mid-batch,
    forced here: the push waits for tokens in flight, not for a time."""
    budget = 64
    other = make_tiny_hf(tmp_path / "v1", "qwen2", seed=1)

    def request(rows: list[int], step: int, epoch: int) -> tuple[list[int], RolloutRequest]:
        seeds = [[100 * r + j for j in range(2)] for r in rows]
        return rows, RolloutRequest([[5, 6, 7 + r] for r in rows], n=2, timeout_s=60, sampling_seeds=seeds,
                                    sampling_params={"max_new_tokens": budget, "ignore_eos": True, "temperature": 1.0})

    with serve(tmp_path, max_running=2) as (url, engine):  # 4 samples, 2 slots: 2 still queued at the push
        pool = EnginePool([EngineEndpoint(url)], health_interval_s=0)
        try:
            ranks = _DiskRanks(pool, other)
            ctl = RolloutController(pool, RolloutClient(Router(pool)), ranks, startup_timeout_s=30, log_dir=tmp_path)
            prod = AsyncRollout(ctl, ResumableSampler(4, 2, shuffle=False, seed=0), request, max_staleness=1,
                                partial=True, timeout_s=60)
            prod.start(step=0, version=0, end=1)
            _wait(lambda: any(len(r.output_ids) >= 5 for r in list(engine.scheduler._rows)), "generation never got going")
            assert not prod._ready
            m: dict[str, float] = {}
            prod.push(1, m)
            b = prod.take(0)
            prod.stop()
        finally:
            pool.close()
    assert ranks.versions == [1] and prod.version == 1 and m["async/push_wait_s"] >= 0
    assert b.start_version == 0 and b.continued >= 1
    split = 0
    for s in b.result.samples:
        v = s.token_weight_versions
        assert s.response_length == budget == len(v) and s.finish_reason == "length"  # nothing lost or repeated
        k = v.count("default")
        assert v == ["default"] * k + ["1"] * (budget - k)  # the start weights' tokens, then version 1's
        split += 0 < k < budget
    assert split >= 1, [s.token_weight_versions.count("default") for s in b.result.samples]
    assert b.continued >= split


def _batch(lengths: list[int], width: int = 4) -> TrainBatch:
    b = len(lengths)
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    ids = torch.ones(b, 2 + width, dtype=torch.long)
    return TrainBatch(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(2 + width).repeat(b, 1),
                      responses=torch.ones(b, width, dtype=torch.long), response_mask=mask, uid=torch.tensor([7, 7, 8, 8]))


def test_admit_refuses_samples_older_than_max_staleness() -> None:
    def sample(i: int, versions: list[str]) -> RolloutSample:
        return RolloutSample(i // 2, i % 2, [1, 2], [3] * len(versions), [-1.0] * len(versions), "length",
                             min(versions, key=int), token_weight_versions=versions)
    # trainer at version 3, k = 1: a sample whose oldest token is version 1 is refused, even when
    # a partial rollout continued it with version 3
    res = RolloutResult([sample(0, ["2", "2", "2", "2"]), sample(1, ["1", "1", "3", "3"]),
                         sample(2, ["3", "3", "3", "3"]), sample(3, ["1", "1"])], n=2)
    d = SimpleNamespace(batch=_batch([4, 4, 4, 2]), result=res, token_level_scores=torch.ones(4, 4))
    prod = AsyncRollout(None, None, _request, max_staleness=1, partial=True, timeout_s=1)
    m: dict[str, float] = {}
    prod.admit(d, 3, SimpleNamespace(continued=2, gen_s=0.5), m)
    assert d.batch.response_mask.sum(-1).tolist() == [4, 0, 4, 0]
    assert d.token_level_scores.sum(-1).tolist() == [4.0, 0.0, 4.0, 0.0]
    assert d.batch.uid.tolist()[0] == 7 and d.batch.uid.tolist()[1] < 0  # out of its group's baseline
    assert m["async/stale_dropped"] == 2 and m["async/staleness/max"] == 2
    assert m["async/staleness/mean"] == (1 + 2 + 0 + 2) / 4 and m["async/partial_samples"] == 1
    assert m["async/continued_segments"] == 2
