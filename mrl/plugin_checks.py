"""The plan's checks of a plugin, run in the import check's child process (:func:`mrl.plugins.check_in_child`):
the plugin is imported there once and never in ``mrl plan``'s own process. Kept light (no ``mrl.config``), since
the child's imports count against the plugin import timeout."""
from __future__ import annotations

from mrl.plugins import check_signature


def _resolve(key: str, spec: str):
    """The callable ``spec`` names for the extension point ``key`` (its registry's loader: a plugin's decorator
    registers into it)."""
    if key == "reward.function":
        from mrl.rewards.registry import get_reward_fn
        return get_reward_fn(spec)
    if key == "algorithm.adv_estimator":
        from mrl.algorithms.advantages import get_adv_estimator
        return get_adv_estimator(spec)
    if key == "data.sampler.class_path":
        from mrl.data.sampler import get_sampler_cls
        return get_sampler_cls(spec)
    from mrl.algorithms.policy_loss import get_policy_loss_fn
    return get_policy_loss_fn(spec)


def signature(key: str, spec: str, n_positional: int, keywords: list[str]) -> None:
    """The plugin imports, exists and takes the call mrl makes (``n_positional`` arguments and ``keywords``);
    a ValueError naming ``key`` otherwise."""
    check_signature(_resolve(key, spec), key, spec, n_positional, keywords)


def tool_schemas(specs: list[str]) -> list[dict]:
    """The OpenAI function schemas of the configured agent tools (:func:`mrl.agent.tools.load_tools`: a
    ValueError names the tool)."""
    from mrl.agent.tools import load_tools

    return [t.schema for t in load_tools(specs).values()]
