"""Plan-time rules of an engine's width: the built-in torch engine is one device (``engine_tp_size=1``), and an
engine wider than one node (``rollout.engine_tp_size > cluster.n_gpus_per_node``):
SGLang's own multi-node tensor parallelism (``--nnodes``/``--node-rank``/``--dist-init-addr``, launched by
driver/engines.py; docs/driver.md, 'Engines over several nodes'). Each error names the key and the fix.

Allowed: ``rollout.engine=sglang``, ``placement=separate``, on whole nodes (``engine_tp_size`` a multiple of
``n_gpus_per_node``, the engines' devices starting at a node boundary), weights by ``distributed`` (one NCCL
group: SGLang ranks each TP rank ``rank_offset + tp_rank`` with the global tp rank, on whichever node it runs)
or ``disk`` (on a filesystem every engine node reads). ``tensor`` (CUDA IPC) cannot cross nodes and is refused
for separate engines anyway (validate.py); colocated engines over several nodes are not launched.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from mrl.config.layout import RoleLayout, separate_devices
from mrl.net import is_loopback

if TYPE_CHECKING:
    from mrl.config.root import MRLConfig

_WILDCARD_HOSTS = ("0.0.0.0", "::")


def separate_breakdown(cfg: MRLConfig) -> str:
    """What each separate role takes, by the keys that set it (``rollout.num_engines=2 x rollout.engine_tp_size=64 =
    128``): the words of every message about devices the separate roles leave to the actor."""
    parts = []
    for role, n in separate_devices(cfg).items():
        if role == "rollout":
            parts.append(f"rollout.num_engines={cfg.rollout.num_engines} x rollout.engine_tp_size="
                         f"{cfg.rollout.engine_tp_size} = {n}")
        else:
            parts.append(f"{role}.num_devices={n}")
    return ", ".join(parts)


def explain_actor_devices(cfg: MRLConfig, roles: dict[str, RoleLayout], errors: list[str]) -> None:
    """When a layout error is about the actor's devices (``... the 32 devices of the actor``, or of a role sharing
    them) and separate roles took the rest: say which keys took them, so that a too-wide engine
    (``rollout.engine_tp_size``) is named where the actor's grid no longer fits."""
    sep, n = separate_devices(cfg), roles["actor"].count
    if not sum(sep.values()) or not any(f"the {n} devices of the " in e for e in errors):
        return
    errors.append(f"the actor's {n} devices are what the separate roles leave of the {cfg.cluster.world_size} "
                  f"(cluster.nnodes x cluster.n_gpus_per_node): {separate_breakdown(cfg)}; fix: fewer or narrower "
                  "separate roles (e.g. a smaller rollout.engine_tp_size or rollout.num_engines), or more nodes")


def check_engine_span(cfg: MRLConfig, roles: dict[str, RoleLayout], errors: list[str], notes: list[str]) -> None:
    r, c = cfg.rollout, cfg.cluster
    tp, per_node = r.engine_tp_size, c.n_gpus_per_node
    if tp > c.world_size:
        errors.append(f"rollout.engine_tp_size={tp} exceeds the cluster's {c.world_size} devices (cluster.nnodes="
                      f"{c.nnodes} x cluster.n_gpus_per_node={per_node}): one engine cannot be wider than the cluster; "
                      f"fix: rollout.engine_tp_size<={per_node} (one node), or a multiple of it up to {c.world_size}")
        return
    if r.engine == "torch" and 1 < tp and (c.device == "cpu" or tp <= per_node):  # wider: the node rule below
        # the built-in engine has no tensor parallelism: one process on the first of the engine's devices, while the
        # weight sync waits for tp ranks that never join (issue 53: a 600 s hang, then WorkerGroupError)
        errors.append(f"rollout.engine_tp_size={tp} with rollout.engine=torch: the built-in engine runs each engine "
                      "on one device (no tensor parallelism); fix: rollout.engine_tp_size=1 (more engines: "
                      "rollout.num_engines), or rollout.engine=sglang (CUDA) for tensor-parallel engines")
        return
    if c.device == "cpu" or tp <= per_node:
        return  # on CPU a "device" is a gloo rank; the built-in engine's tp is no node question
    what = f"rollout.engine_tp_size={tp} exceeds cluster.n_gpus_per_node={per_node}"
    if tp % per_node:
        up = per_node * (tp // per_node + 1)
        errors.append(f"{what} and is not a multiple of it: an engine wider than a node takes whole nodes of "
                      f"{per_node} GPUs; fix: rollout.engine_tp_size={up} ({up // per_node} whole nodes) or "
                      f"rollout.engine_tp_size<={per_node} (one node)")
        return
    k = tp // per_node
    what += f" (each engine over {k} nodes)"
    if r.engine != "sglang":
        errors.append(f"{what} with rollout.engine={r.engine}: only SGLang engines span nodes (its --nnodes); fix: "
                      f"rollout.engine=sglang, or rollout.engine_tp_size<={per_node}")
        return
    if r.placement != "separate":
        errors.append(f"{what} with rollout.placement=colocated: mrl launches an engine over several nodes only on "
                      "whole nodes of its own (colocated engines release and reload their memory around each update, "
                      "a path not run across nodes); fix: rollout.placement=separate with rollout.num_engines, or "
                      f"rollout.engine_tp_size<={per_node}")
        return
    if r.host not in _WILDCARD_HOSTS and not is_loopback(r.host):  # loopback: refused for nnodes > 1 already
        errors.append(f"rollout.host={r.host} with {what}: every node of an engine binds rollout.host (node-rank 0 "
                      "its HTTP server, the others SGLang's health server), so it must be an address of each node; "
                      "fix: rollout.host=0.0.0.0")
    lay = roles.get("rollout")
    if lay is not None and lay.count and lay.first % per_node:
        others = sum(x.count for name, x in roles.items() if not x.colocated and name not in ("actor", "rollout"))
        errors.append(f"{what}: the separate engines would start at device {lay.first} (node{lay.first // per_node}:"
                      f"{lay.first % per_node}), mid-node, but each engine takes whole nodes; fix: make the other "
                      f"separate roles' devices (ref/critic/reward_model/teacher num_devices, {others} now) a "
                      f"multiple of {per_node}, so that the actor and the engines each get whole nodes")
    if r.weight_sync.transport == "disk":
        notes.append(f"rollout.weight_sync.transport=disk with engines over {k} nodes: every engine node's SGLang "
                     "ranks load their shards from rollout.weight_sync.disk_dir, so it must be on a filesystem all of "
                     "them read (as model.path)")
