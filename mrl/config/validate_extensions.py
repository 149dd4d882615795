"""The mrl plan check of the extension points (algorithm.adv_estimator, actor.policy_loss, data.sampler.class_path,
reward.function): a bare name against the names the built-in modules register (read from their source, free of
torch), a plugin imported and its signature checked against the call mrl makes (mrl/config/extensions.py: the
field type)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from mrl.config.extensions import POINTS
from mrl.plugins import (
    FORMS,
    check_signature,
    closest,
    declared_names,
    is_spec,
    probe_import,
)

if TYPE_CHECKING:
    from mrl.config.root import MRLConfig


def builtin_names(key: str) -> list[str]:
    """Registry names of the built-ins for ``key`` (no import of the registry's module)."""
    return declared_names(*POINTS[key][:2])


def _resolve(key: str, spec: str):
    # Imported here: a plugin brings torch with it (its decorators live in mrl.algorithms).
    if key == "algorithm.adv_estimator":
        from mrl.algorithms.advantages import get_adv_estimator
        return get_adv_estimator(spec)
    if key == "data.sampler.class_path":
        from mrl.data.sampler import get_sampler_cls
        return get_sampler_cls(spec)
    from mrl.algorithms.policy_loss import get_policy_loss_fn
    return get_policy_loss_fn(spec)


def check_extension_points(cfg: MRLConfig, errors: list[str]) -> None:
    """Unknown names, plugins that do not import or lack the function, wrong signatures."""
    values = {"algorithm.adv_estimator": cfg.algorithm.adv_estimator, "actor.policy_loss": cfg.actor.policy_loss,
              "data.sampler.class_path": cfg.data.sampler.class_path}
    for key, spec in values.items():
        _, _, n_pos, keywords = POINTS[key]
        if not is_spec(spec):
            names = builtin_names(key)
            if spec not in names:
                errors.append(f"{key}={spec!r} is not a registered name; {closest(spec, names)}; "
                              f"fix: one of them, or a plugin {FORMS}")
            continue
        try:
            probe_import(spec, key)
            check_signature(_resolve(key, spec), key, spec, n_pos, keywords)
        except ValueError as e:
            errors.append(str(e))
    fn = cfg.reward.function
    if is_spec(fn):
        # torch-free; imports the user's scorer module
        from mrl.rewards.registry import get_reward_fn
        try:
            probe_import(fn, "reward.function")
            check_signature(get_reward_fn(fn), "reward.function", fn, 0,
                            ("solution_str", "ground_truth", "data_source", "extra_info"))
        except ValueError as e:
            errors.append(str(e))
    else:
        from mrl.rewards.registry import reward_names
        if fn not in reward_names():
            errors.append(f"reward.function={fn!r} is not a registered scorer; {closest(fn, reward_names())}; "
                          f"fix: one of them, or a plugin {FORMS}")
