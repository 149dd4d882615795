"""What one trainer rank holds (in its Ray rank process): the actor, its colocated reference (ref.placement=colocated)
and critic, the weight sender.

Constructed inside a Ray rank actor (``mrl.cluster.WorkerGroup``) after RANK/WORLD_SIZE/... are
set; every method is called on all ranks with the same full batch and returns identical results.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from mrl.config import MRLConfig
from mrl.config.run_plan import RunPlan
from mrl.dtypes import torch_dtype
from mrl.observability.fallbacks import collect_fallbacks, fallbacks_in_use
from mrl.workers.batch import TrainBatch
from mrl.workers.side_rank import build_side_worker

if TYPE_CHECKING:
    from mrl.workers.critic import CriticWorker
    from mrl.workers.side_model import SideModelWorker

# Before Megatron is imported (by the workers below, lazily): its fallback warnings are collected
# and the driver prints them once (fallbacks()), not once per rank.
collect_fallbacks()


def engine_world_sizes(engine_tp_size: int, num_engines: int) -> list[int]:
    """Ranks each engine brings to the weight-update group (``group_init_payloads``): every TP rank of every node of
    an engine joins, so ``engine_tp_size`` each (tests/rollout/conformance/test_launch_and_pins.py hands what this
    returns to SGLang's own receiver)."""
    return [engine_tp_size] * num_engines


class TrainRank:
    """Actor + reference + critic (PPO) + colocated RM/teacher (+ weight sync) of this rank; see the driver for the call order."""

    def before_call(self) -> None:
        """Run by the rank actor before every method: Megatron's CPU redirect
        (``mrl.megatron.cpu_support``) is per thread, so it is entered on the thread of this call."""
        if os.environ.get("MRL_DEVICE") == "cpu":
            from mrl.megatron.cpu_support import enable_cpu_support

            enable_cpu_support()

    def __init__(self, cfg: MRLConfig, plan: RunPlan) -> None:
        from mrl.workers.actor import ActorWorker
        from mrl.workers.reference import ColocatedReference

        torch.set_num_threads(int(os.environ.get("MRL_TORCH_THREADS", "1")))
        self.cfg = cfg
        self.transport = plan.transport  # rollout.weight_sync.transport, auto resolved
        self.dtype = plan.dtype  # model.dtype resolved for the device: the in-process engine's too
        self.actor = ActorWorker(
            cfg.actor, model_path=cfg.model.path, device=plan.device,
            mini_batch_size_samples=plan.actor.mini_batch_size_samples,
            temperature=cfg.rollout.temperature, max_response_length=cfg.rollout.max_response_length,
            total_optimizer_steps=plan.actor.total_optimizer_steps,
            seed=cfg.trainer.seed, dtype=torch_dtype(plan.dtype), shared_prefix=plan.shared_prefix,
            distill=cfg.algorithm.distill, remove_padding=plan.remove_padding,
            attention_backend=plan.attention_backend("actor"),
        )
        # Snapshot of the start weights, before any update (verl's ref = initial policy). A separate reference
        # (ref.placement=separate) has ranks of its own (mrl/workers/side_rank.py): none here.
        colocated_ref = cfg.ref_enabled and cfg.ref.placement == "colocated"
        self.ref = ColocatedReference(self.actor) if colocated_ref else None
        self.critic = _build_critic(cfg, plan, self.actor.model.device.type) if plan.critic else None
        # Colocated side models (reward model, teacher: mrl/workers/side_model.py) on the actor's ranks and
        # Megatron groups; a separate one has ranks of its own (mrl/workers/side_rank.py)
        self.side: dict[str, SideModelWorker] = {}
        for role, side in cfg.rank_side_models().items():
            if side.enable and side.colocated:
                self.side[role] = build_side_worker(role, cfg, plan, cfg.actor.megatron,
                                                    device=self.actor.model.device.type, init_parallel=False)
                if side.offload:  # on the device only during its phase
                    self.side[role].offload()
        self.syncer = None
        self.local_engine = None  # rollout.weight_sync.transport=inprocess: this rank's engine (start_engine)

    def start_engine(self, urls: list[str], token: str | None) -> None:
        """transport=inprocess: serve engine ``r`` of the pool (``urls[r]``, r = this rank) from threads of
        this process (mrl/rollout/engine/in_process.py); returns once it answers."""
        from urllib.parse import urlsplit

        from mrl.rollout.engine.in_process import InProcessEngine

        r = self.cfg.rollout
        index = torch.distributed.get_rank()
        u = urlsplit(urls[index])
        self.local_engine = InProcessEngine(
            self.cfg.model.path, host=r.host, port=int(u.port), token=token,
            dtype=self.dtype, seed=self.cfg.trainer.seed + index,
            max_running=r.max_num_seqs, startup_timeout_s=r.engine_startup_timeout_s,
            enable_return_routed_experts=self.cfg.actor.moe.engine_routed_experts)

    def init_weight_sync(self, engine_urls: list[str], token: str | None = None, routable: bool = False) -> None:
        """Build the sender: the first DP replica's TP-rank 0 of each PP stage sends; rank 0 steers.
        ``token``: the engines' control token (bound off loopback). ``routable``: some engine runs on
        another node, so the distributed transport's rendezvous uses this node's IP, not loopback."""
        import ray
        from megatron.core import parallel_state as ps

        from mrl.rollout.weight_sync import WeightSyncer

        ws = self.cfg.rollout.weight_sync
        if self.transport == "inprocess":  # each rank loads the engine it hosts: no HTTP, no barrier
            from mrl.rollout.engine.in_process import InProcessSyncer

            if self.local_engine is None:
                raise RuntimeError("transport=inprocess: init_weight_sync before start_engine")
            self.syncer = InProcessSyncer(self.local_engine, verify=ws.verify)
            return
        first_replica = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
        self.syncer = WeightSyncer(
            self.transport, engine_urls, bucket_mb=ws.bucket_mb, verify=ws.verify,
            stage=ps.get_pipeline_model_parallel_rank(),
            is_source=ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0,
            is_coordinator=torch.distributed.get_rank() == 0,
            # the export gathers over TP (and EP, which spans DP replicas): other replicas need not iterate it
            drives_export=first_replica or ps.get_expert_model_parallel_world_size() > 1,
            engine_world_sizes=engine_world_sizes(self.cfg.rollout.engine_tp_size, len(engine_urls)),
            disk_dir=ws.disk_dir, snapshot_dir=ws.snapshot_dir, token=token,
            master_address=ray.util.get_node_ip_address() if routable else "127.0.0.1",
            cuda_ipc=False if self.cfg.rollout.engine == "torch" else None,  # the built-in engine reads shared memory
        )
        self.syncer.init()

    def rejoin_weight_sync(self) -> None:
        """An engine restarted: the distributed transport forms its group again (all ranks call)."""
        if self.syncer is None:
            raise RuntimeError("rejoin_weight_sync before init_weight_sync")
        self.syncer.rejoin()

    def compute_log_prob(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor.compute_log_prob(batch)

    def compute_ref_log_prob(self, batch: TrainBatch) -> torch.Tensor:
        if self.ref is None:
            raise RuntimeError("compute_ref_log_prob called but no reference was built on the trainer ranks "
                               "(ref_enabled is false, or ref.placement=separate: its own group answers)")
        return self.ref.compute_ref_log_prob(batch)

    def compute_repr_similarity(self, batch: TrainBatch, gold: TrainBatch) -> torch.Tensor:
        """[B] cosine of reference response embeddings, generated vs gold (algorithm.repr_align)."""
        if self.ref is None:
            raise RuntimeError("compute_repr_similarity called but no reference was built on the trainer ranks "
                               "(ref_enabled is false, or ref.placement=separate, which config validation refuses)")
        return self.ref.compute_repr_similarity(batch, gold)

    def compute_side(self, role: str, batch: TrainBatch) -> torch.Tensor:
        """What colocated side model ``role`` computes (reward_model: [B] scores; teacher: [B, R] log-probs of the
        sampled tokens), on the device for the call when its section offloads it."""
        worker = self.side.get(role)
        if worker is None:
            raise RuntimeError(f"compute_side({role!r}) called but no {role} was built on the trainer ranks "
                               f"({role}.enable is false, or placement=separate: its own group answers)")
        if not self.cfg.rank_side_models()[role].offload:
            return worker.compute(batch)
        worker.onload()
        try:
            return worker.compute(batch)
        finally:
            worker.offload()

    def update_policy(self, batch: TrainBatch) -> dict[str, float]:
        return self.actor.update_policy(batch)

    def update_policy_on_policy(self, batch: TrainBatch) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        """actor.on_policy_shortcut: the update without an old-log-prob pass; (metrics, log-probs, entropies)."""
        return self.actor.update_policy_on_policy(batch)

    def update_policy_on_policy_and_sync(self, batch: TrainBatch, version: int
                                         ) -> tuple[dict[str, float], torch.Tensor, torch.Tensor, dict[str, float]]:
        """``update_policy_on_policy`` then ``sync_weights(version)`` in one call (RunPlan.push_with_update:
        transport=inprocess, where the sync is this rank's own copy into its engine); the last element is
        the sync's report."""
        metrics, lp, ent = self.actor.update_policy_on_policy(batch)
        return metrics, lp, ent, self.sync_weights(version, pause=False)

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        with self._critic_on() as critic:
            return critic.compute_values(batch)

    def update_critic(self, batch: TrainBatch) -> dict[str, float]:
        with self._critic_on() as critic:
            return critic.update_critic(batch)

    def save_critic(self, ckpt_dir: str) -> None:
        with self._critic_on() as critic:
            critic.save(ckpt_dir)

    def load_critic(self, ckpt_dir: str) -> None:
        with self._critic_on() as critic:
            critic.load(ckpt_dir)

    @contextlib.contextmanager
    def _critic_on(self) -> Iterator[CriticWorker]:
        """The critic on the device for one phase; with critic.offload_* it goes back to host memory
        afterwards (all of params, grads and Adam state: the mixin moves them together; a no-op on CPU)."""
        if self.critic is None:
            raise RuntimeError("a critic method was called but no critic was built (critic_enabled is false)")
        offload = self.cfg.critic.offload_param or self.cfg.critic.offload_grad or self.cfg.critic.offload_optimizer
        if offload:
            self.critic.onload()
        try:
            yield self.critic
        finally:
            if offload:
                self.critic.offload()

    def sync_weights(self, version: int, pause: bool = True) -> dict[str, float]:
        """``pause``: WeightSyncer.sync's (False: the driver generates nothing until the sync returns)."""
        if self.syncer is None:
            raise RuntimeError("sync_weights before init_weight_sync")
        # LoRA: only the adapted (merged) weights change once the engines hold the base; the disk
        # transport has the engines reload a whole checkpoint directory, so it always sends all.
        only_lora = (self.cfg.actor.lora.enabled and getattr(self, "_synced_once", False)
                     and self.transport != "disk")
        weights = self.actor.export_hf_weights(only_lora=only_lora)
        # a frozen vision tower never changes: once the engines hold it, it leaves the per-step payload
        tower = self.actor.model.vision
        if (tower is not None and self.cfg.actor.freeze_vision_tower and getattr(self, "_synced_once", False)
                and self.transport != "disk"):
            weights = ((n, t) for n, t in weights if not n.startswith(tower.prefix))
        metrics = self.syncer.sync(weights, version, pause=pause).metrics()
        self._synced_once = True
        return metrics

    def save(self, ckpt_dir: str, contents: list[str]) -> None:
        """``contents``: actor.checkpoint.save_contents."""
        self.actor.save_checkpoint(ckpt_dir, contents)

    def load(self, ckpt_dir: str, contents: list[str]) -> None:
        """``contents``: actor.checkpoint.load_contents with its default applied (``ActorCheckpointConfig.load``)."""
        self.actor.load_checkpoint(ckpt_dir, contents)

    def fallbacks(self) -> list[str]:
        """The Megatron/torch fallbacks this rank's process hit (mrl/observability/fallbacks.py)."""
        return fallbacks_in_use()

    def close(self) -> None:
        if self.syncer is not None:
            self.syncer.close()
        if self.local_engine is not None:
            self.local_engine.stop()
            self.local_engine = None


def _build_critic(cfg: MRLConfig, plan: RunPlan, device: str) -> CriticWorker:
    """The colocated critic: same ranks and Megatron groups as the actor (``init_parallel=False``;
    config validation refuses a critic.megatron layout that differs), started in host memory when
    offloading is configured."""
    from mrl.workers.critic import CriticWorker

    c, u = cfg.critic, plan.critic
    critic = CriticWorker(
        c, model_path=c.model_path or cfg.model.path, device=device, mini_batch_size_samples=u.mini_batch_size_samples,
        epochs=u.epochs, total_optimizer_steps=u.total_optimizer_steps,
        seed=cfg.trainer.seed, init_parallel=False, max_response_length=cfg.rollout.max_response_length,
        # the actor's dispatcher and aux loss; never the policy's routing replayed in the value model's router
        dtype=torch_dtype(plan.dtype), moe=cfg.actor.moe.model_copy(update={"routing_replay": "none"}),
        remove_padding=plan.remove_padding,
    )
    if c.offload_param or c.offload_grad or c.offload_optimizer:
        critic.offload()
    return critic
