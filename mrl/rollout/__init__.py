"""Rollout: SGLang-protocol engines (embedded torch engine or real SGLang), router/pool, client,
and weight sync from the Megatron actor.

The embedded engine lives in ``mrl.rollout.engine`` and is served by ``mrl.rollout.engine.server``
(``mrl engine --model HF_DIR --port P``); its JSON shapes are in ``mrl.rollout.protocol``.
"""
from __future__ import annotations

import importlib

# Resolved lazily: `mrl engine` imports mrl.rollout.engine.server and should not pay for the pool's
# HTTP client or the weight-sync stack, and the driver should not pay for FastAPI.
_EXPORTS = {
    "RolloutClient": "mrl.rollout.client",
    "RolloutRequest": "mrl.rollout.types",
    "RolloutSample": "mrl.rollout.types",
    "RolloutResult": "mrl.rollout.types",
    "EnginePool": "mrl.rollout.pool",
    "EngineEndpoint": "mrl.rollout.pool",
    "Router": "mrl.rollout.router",
    "make_router": "mrl.rollout.router",
    "EngineProcess": "mrl.rollout.sglang_launcher",
    "SGLangLaunchSpec": "mrl.rollout.sglang_launcher",
    "build_sglang_command": "mrl.rollout.sglang_launcher",
    "build_embedded_command": "mrl.rollout.sglang_launcher",
    "WeightSyncer": "mrl.rollout.weight_sync",
    "WeightSyncReport": "mrl.rollout.weight_sync",
    "disk_resync": "mrl.rollout.weight_sync",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mrl.rollout' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
