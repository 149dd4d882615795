"""Device layout: which role runs on which devices, and each role's data-parallel size.

Devices are numbered globally ``0 .. nnodes * n_gpus_per_node - 1`` (node = index // n_gpus_per_node).
The actor takes every device not claimed by a ``separate`` role; colocated roles (reference,
critic, engines, reward model, teacher) share the actor's devices and run in turn (verl hybrid engine).
Separate roles are laid out after the actor in the order reference, critic, rollout, reward model, teacher:

    devices = nnodes * n_gpus_per_node = actor + Σ separate roles
    e.g. 4 = actor 2 [0-1] + reward_model.num_devices 2 [2-3]

For a Megatron role ``DP = devices / (TP * PP * CP)``.
"""
from __future__ import annotations

from dataclasses import dataclass

from mrl.config.parallel import ParallelConfig
from mrl.config.root import MRLConfig


@dataclass(frozen=True)
class RoleLayout:
    """Devices [first, first + count) of one role; ``parallel`` is None for the engines."""

    name: str
    first: int
    count: int
    colocated: bool
    parallel: ParallelConfig | None = None

    @property
    def dp(self) -> int:
        """Data-parallel size (0 when the devices do not divide by TP*PP*CP)."""
        if self.parallel is None:
            return 0
        mp = self.parallel.model_parallel_size
        return self.count // mp if self.count % mp == 0 else 0

    def nodes(self, per_node: int) -> str:
        """Human-readable node/device ranges, e.g. 'node0:0-7, node1:0-3'; three or more whole nodes in a row
        fold into one range ('node0-31:0-7')."""
        spans: list[tuple[int, int, int]] = []  # (node, first device, last device)
        d = self.first
        end = self.first + self.count
        while d < end:
            node = d // per_node
            stop = min(end, (node + 1) * per_node)
            spans.append((node, d % per_node, (stop - 1) % per_node))
            d = stop
        parts: list[str] = []
        i = 0
        while i < len(spans):
            node, a, b = spans[i]
            j = i
            while (j + 1 < len(spans) and (a, b) == (0, per_node - 1) and spans[j + 1] == (spans[j][0] + 1, a, b)):
                j += 1
            dev = f"{a}" if a == b else f"{a}-{b}"
            if j - i >= 2:
                parts.append(f"node{node}-{spans[j][0]}:{dev}")
            else:
                parts.extend(f"node{n}:{dev}" for n, _, _ in spans[i:j + 1])
            i = j + 1
        return ", ".join(parts)


def separate_devices(cfg: MRLConfig) -> dict[str, int]:
    """Devices claimed by each separate role (absent/None sizes count as 0; validation reports them)."""
    out: dict[str, int] = {}
    if cfg.ref_enabled and cfg.ref.placement == "separate":
        out["ref"] = cfg.ref.num_devices or 0
    if cfg.critic_enabled and cfg.critic.placement == "separate":
        out["critic"] = cfg.critic.num_devices or 0
    if cfg.rollout.placement == "separate":
        out["rollout"] = (cfg.rollout.num_engines or 0) * cfg.rollout.engine_tp_size
    for role, side in cfg.rank_side_models().items():
        if side.enable and not side.colocated:
            out[role] = side.num_devices or 0
    return out


def engine_nodes(cfg: MRLConfig) -> int:
    """Nodes one engine spans: 1, or for an SGLang engine wider than a node ``engine_tp_size / n_gpus_per_node``
    whole nodes (its ``--nnodes``; config/validate_engines.py refuses the layouts that cannot run)."""
    tp, per_node = cfg.rollout.engine_tp_size, cfg.cluster.n_gpus_per_node
    sglang = cfg.rollout.engine == "sglang" and cfg.cluster.device != "cpu"
    return tp // per_node if sglang and tp > per_node and tp % per_node == 0 else 1


def num_engines(cfg: MRLConfig, actor_devices: int) -> int:
    """rollout.num_engines, or for colocated engines with null: actor devices // engine_tp_size."""
    if cfg.rollout.num_engines is not None:
        return cfg.rollout.num_engines
    if cfg.rollout.placement == "colocated":
        return max(actor_devices // cfg.rollout.engine_tp_size, 0)
    return 0


def compute_layout(cfg: MRLConfig) -> dict[str, RoleLayout]:
    """Role -> RoleLayout for actor, ref, critic, rollout, reward_model and teacher (each if enabled)."""
    world = cfg.cluster.world_size
    sep = separate_devices(cfg)
    actor_n = max(world - sum(sep.values()), 0)
    roles = {"actor": RoleLayout("actor", 0, actor_n, False, cfg.actor.megatron)}
    nxt = actor_n
    # A colocated reference runs in the actor's model chunks (mrl/workers/reference.py): the actor's layout.
    ref_par = cfg.ref.megatron if cfg.ref.placement == "separate" else cfg.actor.megatron
    sides = cfg.rank_side_models()
    for name, par in (("ref", ref_par), ("critic", cfg.critic.megatron), ("rollout", None),
                      *((role, side.parallel(cfg.actor.megatron)) for role, side in sides.items())):
        enabled = {"ref": cfg.ref_enabled, "critic": cfg.critic_enabled, "rollout": True,
                   **{role: side.enable for role, side in sides.items()}}[name]
        if not enabled:
            continue
        if name in sep:
            roles[name] = RoleLayout(name, nxt, sep[name], False, par)
            nxt += sep[name]
        elif name == "rollout":
            n = num_engines(cfg, actor_n) * cfg.rollout.engine_tp_size
            roles[name] = RoleLayout(name, 0, n, True, None)
        else:
            roles[name] = RoleLayout(name, 0, actor_n, True, par)
    return roles
