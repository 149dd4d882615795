"""Rollout: SGLang-protocol engines (embedded torch engine or real SGLang), router/pool, client,
and weight sync from the Megatron actor.

The embedded engine lives in ``mrl.rollout.engine`` and is served by ``mrl.rollout.server``
(``mrl engine --model HF_DIR --port P``); its JSON shapes are in ``mrl.rollout.protocol``.
"""
