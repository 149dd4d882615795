"""What the ``auto`` settings choose: the fast valid option for the run's device and shape.

Resolved once, into the run plan (:func:`mrl.config.run_plan.plan_run`); ``mrl plan`` prints each
choice with its reason. A value other than ``auto`` is taken as given (``check_config`` judges it).

``rollout.weight_sync.transport: auto``
    inprocess  CPU, and the layout fits it (built-in engine colocated on every trainer rank, actor
               TP = PP = 1, synchronous steps; :func:`inprocess_blockers`): no protocol, each rank
               copies its weights into its own engine (faster than ``tensor``: docs/performance.md,
               'auto: transport and shared prefix')
    tensor     colocated otherwise, on one node: shared memory on CPU, CUDA IPC on GPUs (no copy;
               ``distributed`` is refused colocated on CUDA: NCCL will not put two ranks on one GPU)
    disk       colocated CUDA engines over several nodes (IPC handles do not cross nodes and NCCL
               refuses the colocated group: the one valid transport)
    distributed separate engines: one NCCL/gloo broadcast per bucket

``actor.shared_prefix: auto`` -- on when all hold, from the measurements in docs/vs_trl.md:

    device is CPU                     (Megatron's local attention; Transformer Engine ignores the
                                       mask, and on CUDA the unfused local attention is unmeasured)
    rollout.n >= 2                    (a prompt shared by nothing saves nothing)
    R <= P                            answers no longer than prompts (R = rollout.max_response_length,
                                       P = data.max_prompt_length): the n·P repeated prompt tokens are
                                       at least half the compact layout's n·(P + R)
    P + n·(R − 1) <= 512              the longest shared row stays short: its masked attention grows
                                       with the row's square
    no MoE routing replay             the engine's expert ids are per sample and per token

    The shapes it was measured at, on and off: docs/performance.md, 'auto: transport and shared prefix'.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mrl.config.layout import compute_layout
from mrl.config.root import MRLConfig

SHARED_ROW_MAX = 512  # tokens: the longest shared-prefix row `auto` accepts


@dataclass(frozen=True)
class AutoChoice:
    """One resolved ``auto`` (or given) setting: the config key, the value used, and why."""

    key: str
    value: Any
    why: str

    def line(self) -> str:
        return f"{self.key}={str(self.value).lower() if isinstance(self.value, bool) else self.value}: {self.why}"


def inprocess_blockers(cfg: MRLConfig) -> list[str]:
    """Why the engines cannot run inside the trainer ranks (transport=inprocess), the device aside: [] = they can."""
    r, m = cfg.rollout, cfg.actor.megatron
    why = []
    if r.engine != "torch":
        why.append(f"rollout.engine={r.engine} (the built-in engine only)")
    if r.placement != "colocated":
        why.append(f"rollout.placement={r.placement} (colocated only)")
    if r.engine_tp_size != 1:
        why.append(f"rollout.engine_tp_size={r.engine_tp_size} (1 only)")
    if m.tensor_model_parallel_size != 1 or m.pipeline_model_parallel_size != 1:
        why.append(f"actor TP={m.tensor_model_parallel_size}, PP={m.pipeline_model_parallel_size} (every rank must hold "
                   "the whole model: TP = PP = 1)")
    if r.num_engines is not None and r.num_engines != compute_layout(cfg)["actor"].count:
        why.append(f"rollout.num_engines={r.num_engines} (one per trainer rank: null)")
    if r.weight_sync.snapshot_dir:
        why.append("rollout.weight_sync.snapshot_dir is set (an in-process engine is never restarted on its own)")
    if r.router != "builtin":
        why.append(f"rollout.router={r.router} (builtin only)")
    if cfg.trainer.async_training.max_staleness > 0:
        why.append(f"trainer.async_training.max_staleness={cfg.trainer.async_training.max_staleness} (the engine "
                   "would generate on the rank's cores while it trains: synchronous steps only)")
    return why


def resolve_transport(cfg: MRLConfig, device: str) -> AutoChoice:
    """rollout.weight_sync.transport on ``device`` (see the module docstring)."""
    key, want = "rollout.weight_sync.transport", cfg.rollout.weight_sync.transport
    if want != "auto":
        return AutoChoice(key, want, "set in the config")
    blockers = inprocess_blockers(cfg)
    if device == "cpu" and not blockers:
        return AutoChoice(key, "inprocess", "auto: CPU with the built-in engine on every trainer rank, so each rank "
                          "copies its weights into its own engine (no protocol)")
    if cfg.rollout.placement == "colocated":
        if device == "cpu":
            return AutoChoice(key, "tensor", "auto: colocated on CPU, shared memory (not inprocess: "
                              + "; ".join(blockers) + ")")
        if cfg.cluster.nnodes == 1:
            return AutoChoice(key, "tensor", "auto: colocated on one CUDA node, CUDA IPC handles (no copy)")
        return AutoChoice(key, "disk", f"auto: colocated CUDA engines over cluster.nnodes={cfg.cluster.nnodes} (IPC "
                          "handles do not cross nodes, NCCL refuses an engine on its trainer rank's GPU)")
    return AutoChoice(key, "distributed", "auto: separate engines, one broadcast per bucket")


def resolve_shared_prefix(cfg: MRLConfig, device: str) -> AutoChoice:
    """actor.shared_prefix on ``device`` (see the module docstring)."""
    key, want = "actor.shared_prefix", cfg.actor.shared_prefix
    if want != "auto":
        return AutoChoice(key, bool(want), "set in the config")
    n, P, R = cfg.rollout.n, cfg.data.max_prompt_length, cfg.rollout.max_response_length
    row = P + n * (R - 1)
    shape = f"n={n}, P=data.max_prompt_length={P}, R=rollout.max_response_length={R}"
    if device != "cpu":
        return AutoChoice(key, False, f"auto: off on {device} (measured on CPU only; Transformer Engine ignores the mask)")
    if n < 2:
        return AutoChoice(key, False, f"auto: off, rollout.n={n} (no prompt to share)")
    if cfg.actor.moe.routing_replay != "none":
        return AutoChoice(key, False, "auto: off, actor.moe.routing_replay replays each sample's own expert ids, "
                          "which the shared-prefix rows merge")
    if R > P:
        return AutoChoice(key, False, f"auto: off, answers longer than prompts ({shape}): little to share")
    if row > SHARED_ROW_MAX:
        return AutoChoice(key, False, f"auto: off, shared rows of up to P + n(R-1) = {row} > {SHARED_ROW_MAX} tokens "
                          f"({shape}): the masked attention would grow with their square")
    return AutoChoice(key, True, f"auto: on, prompts at least as long as answers ({shape}): each prompt computed "
                      f"once for its {n} samples, rows of <= {row} tokens")


def planned_device(cfg: MRLConfig) -> str:
    """cluster.device as ``mrl plan`` assumes it (auto: cuda when an NVIDIA GPU is visible here)."""
    from mrl.config.validate import _on_cuda

    return "cuda" if _on_cuda(cfg) else "cpu"
