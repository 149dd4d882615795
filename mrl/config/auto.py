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
    no linear-attention layers        a Gated DeltaNet recurrence (Qwen3.5) cannot branch several samples off one
                                       prompt inside a row (``true`` is refused for such a model)
    no sparse attention               DeepSeek-V3.2 / GLM-5's indexer picks its top-k over whole causal rows
                                       (``true`` is refused for such a model)
    actor CP = 1                      context parallelism cuts packed rows

    The shapes it was measured at, on and off: docs/performance.md, 'auto: transport and shared prefix'.

``<role>.megatron.attention_backend: auto`` (every Megatron role)
    te         CUDA, Transformer Engine importable, no LoRA (TE's fused attention and layers)
    sdpa       otherwise: torch's scaled_dot_product_attention in Megatron's local spec (flash kernels,
               no s x s scores; LoRA's adapters need the local spec's unfused norm + linear)

``actor.use_remove_padding: auto`` -- padding-free packed micro-batches, on when all hold:

    every packing role's attention resolves to sdpa   (actor, ref, critic, teacher; the packed rows' boundaries are
                                                       applied by mrl's SDPA module; TE's THD path is not
                                                       wired yet)
    actor.shared_prefix resolves off                  (its rows already hold several masked segments)
"""
from __future__ import annotations

import glob
import shutil
from dataclasses import dataclass
from typing import Any

from mrl.config.layout import compute_layout
from mrl.config.root import MRLConfig
from mrl.megatron.backends import choose_attention_backend as choose_backend

SHARED_ROW_MAX = 512  # tokens: the longest shared-prefix row `auto` accepts
PADDED_ROLES = ("reward_model.",)  # roles whose forwards read compact columns and never pack


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
    if cfg.actor.use_remove_padding is True:
        return AutoChoice(key, False, "auto: off, actor.use_remove_padding=true packs the rows instead")
    cp = [role for role, par, _ in megatron_roles(cfg) if par.context_parallel_size > 1 and role != "reward_model"]
    if cp:  # the reward model packs its own rows under CP; the other roles take the actor's row layout
        return AutoChoice(key, False, f"auto: off, context parallelism ({cp[0]}.megatron.context_parallel_size > 1) "
                          "cuts packed rows")
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
    if model_is_hybrid(cfg):
        return AutoChoice(key, False, "auto: off, the model's Gated DeltaNet layers run a recurrence over each whole "
                          "sequence, which the shared-prefix rows' masked segments would break")
    from mrl.config.validate_vision import vision_config_of

    if vision_config_of(cfg.model.path) is not None:
        return AutoChoice(key, False, "auto: off, a vision-language model's 3-D positions are computed per whole "
                          "sequence, which the shared-prefix rows' segments do not keep")
    if model_is_dsa(cfg):
        return AutoChoice(key, False, "auto: off, the model's sparse-attention indexer selects its top-k over each "
                          "whole causal sequence, not over the shared-prefix rows' masked segments")
    if R > P:
        return AutoChoice(key, False, f"auto: off, answers longer than prompts ({shape}): little to share")
    if row > SHARED_ROW_MAX:
        return AutoChoice(key, False, f"auto: off, shared rows of up to P + n(R-1) = {row} > {SHARED_ROW_MAX} tokens "
                          f"({shape}): the masked attention would grow with their square")
    return AutoChoice(key, True, f"auto: on, prompts at least as long as answers ({shape}): each prompt computed "
                      f"once for its {n} samples, rows of <= {row} tokens")


def choose_attention_backend(want: str, *, device: str, te_importable: bool, lora: bool,
                             key: str = "actor.megatron.attention_backend", mla: bool = False,
                             hybrid: bool = False) -> AutoChoice:
    """``<role>.megatron.attention_backend`` on ``device`` (the rule: :mod:`mrl.megatron.backends`, which the ranks
    apply too); ``te_importable``: TE's PyTorch extension imports where the ranks run; ``mla``: the role's model has
    multi-latent attention; ``hybrid``: Gated DeltaNet layers."""
    value, why = choose_backend(want, device=device, te_importable=te_importable, lora=lora, mla=mla, hybrid=hybrid)
    return AutoChoice(key, value, why)


# the roles built from model.path (the reward model and the teacher have their own checkpoints)
POLICY_ROLES = ("actor", "ref", "critic")


def _model_shape(cfg: MRLConfig):
    """model.path's shape (or that of mrl's bundled copy of its config.json); None when unknown or unreadable
    (load_shape reports an unreadable one)."""
    from mrl.config.hf import bundled_hub_shape, read_model_shape

    if not cfg.model.path:
        return None
    try:
        shape = read_model_shape(cfg.model.path)
    except ValueError:
        return None
    return shape or bundled_hub_shape(cfg.model.path)


def model_is_mla(cfg: MRLConfig) -> bool:
    """model.path is a multi-latent-attention model (DeepSeek-V3)."""
    shape = _model_shape(cfg)
    return shape is not None and shape.mla is not None


def model_is_hybrid(cfg: MRLConfig) -> bool:
    """model.path has Gated DeltaNet linear-attention layers (Qwen3.5, Qwen3-Next)."""
    shape = _model_shape(cfg)
    return shape is not None and shape.linear_layers > 0


def model_is_dsa(cfg: MRLConfig) -> bool:
    """model.path has DeepSeek sparse attention (DeepSeek-V3.2, GLM-5: a top-k indexer over each whole sequence)."""
    shape = _model_shape(cfg)
    return shape is not None and shape.dsa is not None


def te_importable_here() -> bool:
    """Transformer Engine's PyTorch extension is installed in this environment (found, not imported)."""
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def megatron_roles(cfg: MRLConfig) -> list[tuple[str, Any, bool]]:
    """(role, its ParallelConfig, LoRA on) of every Megatron model the run builds."""
    roles: list[tuple[str, Any, bool]] = [("actor", cfg.actor.megatron, cfg.actor.lora.enabled)]
    if cfg.ref_enabled:
        roles.append(("ref", cfg.ref.megatron, False))
    if cfg.critic_enabled:
        roles.append(("critic", cfg.critic.megatron, False))
    for role, side in cfg.rank_side_models().items():
        if side.enable:
            roles.append((role, side.parallel(cfg.actor.megatron), False))
    return roles


def resolve_attention_backends(cfg: MRLConfig, device: str) -> list[AutoChoice]:
    """Each Megatron role's attention backend (see the module docstring)."""
    te, mla, hybrid = te_importable_here(), model_is_mla(cfg), model_is_hybrid(cfg)
    return [choose_attention_backend(par.attention_backend, device=device, te_importable=te, lora=lora,
                                     key=f"{role}.megatron.attention_backend", mla=mla and role in POLICY_ROLES,
                                     hybrid=hybrid and role in POLICY_ROLES)
            for role, par, lora in megatron_roles(cfg)]


def backend_of(choices: list[AutoChoice] | tuple[AutoChoice, ...], role: str) -> str:
    """The resolved attention backend of ``role`` (sdpa when the role has no choice: not built)."""
    for c in choices:
        if c.key == f"{role}.megatron.attention_backend":
            return str(c.value)
    return "sdpa"


def packing_blockers(backends: list[AutoChoice] | tuple[AutoChoice, ...]) -> list[AutoChoice]:
    """The resolved backends that keep packed rows from running: a role that packs (not the reward model, which
    scores compact rows) on an attention other than sdpa."""
    return [c for c in backends if c.value != "sdpa" and not c.key.startswith(PADDED_ROLES)]


def resolve_remove_padding(cfg: MRLConfig, device: str, shared_prefix: AutoChoice,
                           backends: list[AutoChoice]) -> AutoChoice:
    """actor.use_remove_padding (see the module docstring); an explicit ``true`` that cannot run is
    check_config's error, not silently turned off here."""
    key, want = "actor.use_remove_padding", cfg.actor.use_remove_padding
    if want != "auto":
        return AutoChoice(key, bool(want), "set in the config")
    other = packing_blockers(backends)
    if other:
        return AutoChoice(key, False, f"auto: off, {other[0].key}={other[0].value} (packed rows need the sdpa "
                          "attention backend)")
    if shared_prefix.value:
        return AutoChoice(key, False, "auto: off, actor.shared_prefix is on (its rows share each prompt instead)")
    return AutoChoice(key, True, "auto: on, each micro-batch one row of whole sequences (no padding; attention "
                      "and RoPE restart at every sequence)")


def resolve_all(cfg: MRLConfig, device: str) -> tuple[AutoChoice, ...]:
    """Every auto-resolvable setting of ``cfg`` on ``device``, in the order ``mrl plan`` prints them."""
    transport, shared = resolve_transport(cfg, device), resolve_shared_prefix(cfg, device)
    backends = resolve_attention_backends(cfg, device)
    return (transport, shared, *backends, resolve_remove_padding(cfg, device, shared, backends))


def _gpu_visible() -> bool:
    # No torch import at config time: look for the NVIDIA device nodes / tool instead.
    return bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


def _on_cuda(cfg: MRLConfig) -> bool:
    """cluster.device resolved as the workers will resolve it on this host (auto: a visible NVIDIA GPU)."""
    c = cfg.cluster
    return c.device == "cuda" or (c.device == "auto" and _gpu_visible())


def planned_device(cfg: MRLConfig) -> str:
    """cluster.device as ``mrl plan`` assumes it (auto: cuda when an NVIDIA GPU is visible here)."""
    return "cuda" if _on_cuda(cfg) else "cpu"
