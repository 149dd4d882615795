"""The driver's one handle on the engines: generation, weight pushes, sleep/wake and recovery.

The step calls it in one line per phase (``rollout.generate(req, version)``, ``rollout.push(version,
m)``, ``rollout.sleep()``, ``rollout.wake(version)``); what it does with the pool (health, restarts,
readmission, memory release) stays out of the algorithm's class. It is also the seam where a
rollout producer running ahead of the trainer (bounded staleness) can grow: every answer carries
the weight version that produced it.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from mrl.driver.ranks import TrainRanks
from mrl.rollout.types import RolloutRequest, RolloutResult

if TYPE_CHECKING:
    from mrl.rollout.pool import EnginePool


class Generates(Protocol):
    """What the controller generates through: ``RolloutClient`` (through the router), or ``AgentClient``
    (multi-turn tool calls around it)."""

    def generate(self, request: RolloutRequest) -> RolloutResult: ...


class RolloutController:
    """pool: the engines; client: what generates in front of them (possibly through a router and the agent
    loop); ranks: the trainer ranks, which send the weights (None where nothing is pushed: a generation-only
    test). Every generation of the run goes through ``generate``: the step's samples, ReMax's greedy
    baselines and validation answers, so a failed sample or a lost engine is reported one way."""

    def __init__(self, pool: EnginePool, client: Generates, ranks: TrainRanks | None, *, startup_timeout_s: float,
                 log_dir: Path | str | None = None) -> None:
        self.pool, self.client, self.ranks = pool, client, ranks
        self.startup_timeout_s = startup_timeout_s
        self.log_dir = log_dir

    @property
    def asleep(self) -> bool:
        return bool(self.pool.asleep)

    def generate(self, request: RolloutRequest, version: int, what: str = "rollout") -> tuple[RolloutResult, int]:
        """All samples of ``request`` and the weight version the engines reported for them
        (``"default"``, the start weights, is 0); refuses failed samples and any sample not made by
        ``version`` — a sync that missed an engine must not train (or validate) on stale samples silently.
        ``what`` names the samples in errors: rollout, ReMax baseline, validation."""
        res = self.client.generate(request)
        if res.failed:
            self._stop_if_engines_lost(f"{len(res.failed)} of {len(res.samples)} {what} samples failed")
            raise RuntimeError(f"{len(res.failed)} of {len(res.samples)} {what} samples failed, first: "
                               f"{res.failed[0].error}; see the engine logs under {self.log_dir} (or raise "
                               "rollout.request_timeout_s)")
        expected = {str(version)} | ({"default"} if version == 0 else set())
        if res.weight_versions - expected:
            raise RuntimeError(f"engines answered {what} samples with weight versions {res.weight_versions}, expected "
                               f"{version}: the weight sync did not reach every engine (or one restarted "
                               "without a re-sync; set rollout.weight_sync.snapshot_dir to re-sync restarted engines)")
        return res, max(0 if v in (None, "default") else int(v) for v in res.weight_versions)

    def push(self, version: int, m: dict[str, float], *, pause: bool = True) -> None:
        """The actor's weights -> every engine as ``version``; bytes, tensors and buckets summed
        over the sending ranks (one per PP stage) into ``m``, ``timing_s/weight_sync`` their max.
        Sleeping engines get their weight memory back before and their KV cache after (verl's
        order: a lower peak next to the trainer's memory). An engine restarted since the last push
        (no snapshot to re-sync from) rejoins here: the distributed transport re-forms its group
        with it, the push reaches it, then it serves again. ``pause=False``: nothing generates now (the
        synchronous step), so the engines are not paused and resumed around the load (WeightSyncer.sync)."""
        pool = self.pool
        self.check_engines()
        rejoin = any(e.awaiting_sync for e in pool.engines)
        if rejoin:
            self.ranks.rejoin_weight_sync()
        asleep = pool.asleep
        if asleep:
            pool.resume_memory(["weights"])
        try:
            per_rank = self.ranks.sync_weights(version, pause=pause)
        except Exception as e:
            from mrl.cluster.worker_group import RankDiedError

            if not isinstance(e, RankDiedError):  # a dead rank takes its in-process engine along: name the rank
                self._stop_if_engine_died_in_push(version)
            raise
        if asleep:
            pool.resume_memory(["kv_cache"])
        if rejoin:
            pool.readmit(str(version))
        self.pushed(version, per_rank, m)

    def check_engines(self) -> None:
        """Before a push: an engine killed since the last request (no connection to /health) is taken out
        and restarted now, not met by the senders mid-push (a connection error in a trainer rank); any
        restart under way is waited for (bounded: the engine start timeout), and an engine that could not
        be brought back stops the run with a message naming it."""
        pool = self.pool
        if not pool.asleep:  # sleeping engines are not probed (SGLang's /health generates); a push meets them
            pool.take_out_dead()
        try:
            pool.wait_recovered(self.startup_timeout_s)
        except TimeoutError:
            pass  # still recovering: named below
        self._stop_if_engines_lost("before the weight push", waiting=True)

    def _stop_if_engine_died_in_push(self, version: int) -> None:
        """A push that failed because an engine died under it: the senders stopped part-way (their peers
        may wait in a barrier that never completes), so the push cannot be retried; stop naming the engine
        rather than with the sender's connection error. Nothing if every engine still answers."""
        from mrl.errors import RunStoppedError

        gone = {e.url for e in self.pool.take_out_dead()}
        lost = [(i, e) for i, e in enumerate(self.pool.engines) if e.url in gone]
        if lost:
            names = "; ".join(f"engine {i} ({e.url})" for i, e in lost)
            raise RunStoppedError(f"{names} died during the weight push of version {version}: a push cannot be "
                                  f"resumed half-way, so the run stopped; engine logs: {self.log_dir}",
                                  resume_hint=True)

    def _stop_if_engines_lost(self, context: str, waiting: bool = False) -> None:
        """RunStoppedError naming every engine (index, address, why) that is out with no way back."""
        from mrl.errors import RunStoppedError

        lost = [(i, e) for i, e in enumerate(self.pool.engines) if waiting and e.recovering] + self.pool.lost_engines()
        if lost:
            names = "; ".join(f"engine {i} ({e.url}): {e.last_error or 'out of service'}" + (
                "" if e.restart is not None else f" (it runs inside trainer rank {i}, transport=inprocess, which "
                "cannot restart it: that rank died or its server stopped)") for i, e in lost)
            raise RunStoppedError(f"{context}: lost {names}; the pool restarts a dead engine and re-syncs it, and "
                                  f"this one could not be brought back (rollout.engine_startup_timeout_s="
                                  f"{self.startup_timeout_s:.0f}s bounds the wait); engine logs: {self.log_dir}",
                                  resume_hint=True)

    def pushed(self, version: int, per_rank: list[dict[str, float]], m: dict[str, float]) -> None:
        """Record a push the ranks made (``push``, or the update call itself: RunPlan.push_with_update)."""
        for k in {k for r in per_rank for k in r}:
            vals = [float(r.get(k, 0.0)) for r in per_rank]
            m[k] = max(vals) if k.startswith("timing_s/") else sum(vals)
        self.pool.weight_version = str(version)  # what a restarted engine must be re-synced to

    def sleep(self) -> None:
        """verl's free_cache_engine: colocated engines give the device memory to the trainer."""
        self.pool.release_memory()

    def wake(self, version: int) -> None:
        """Engines released after the last generation and not synced since (critic warmup,
        validation) get the current version pushed again: released weights are not kept (SGLang's
        memory saver drops them). A no-op when the engines are awake."""
        if self.pool.asleep:
            self.push(version, {})

    def resumed(self, version: int) -> None:
        """The engines started from model.path: push the resumed weights as the saved version."""
        self.ranks.sync_weights(version)
        self.pool.weight_version = str(version)
