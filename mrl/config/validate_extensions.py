"""The mrl plan check of the extension points (algorithm.adv_estimator, actor.policy_loss, data.sampler.class_path,
reward.function): a bare name against the names the built-in modules register (read from their source, free of
torch), a plugin imported and its signature checked against the call mrl makes (mrl/config/extensions.py: the
field type), both in the import check's child process (one import of the plugin, none in the plan's process)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from mrl.config.extensions import POINTS
from mrl.plugins import (
    FORMS,
    check_in_child,
    closest,
    declared_names,
    is_spec,
)

# what mrl passes a reward function (mrl/rewards): the plan checks a plugin scorer takes them
REWARD_KEYWORDS = ("solution_str", "ground_truth", "data_source", "extra_info")

if TYPE_CHECKING:
    from mrl.config.root import MRLConfig


def builtin_names(key: str) -> list[str]:
    """Registry names of the built-ins for ``key`` (no import of the registry's module)."""
    return declared_names(*POINTS[key][:2])


def check_extension_points(cfg: MRLConfig, errors: list[str]) -> None:
    """Unknown names, plugins that do not import or lack the function, wrong signatures."""
    values = {"algorithm.adv_estimator": cfg.algorithm.adv_estimator, "actor.policy_loss": cfg.actor.policy_loss,
              "data.sampler.class_path": cfg.data.sampler.class_path}
    for key, spec in values.items():
        if not is_spec(spec):
            names = builtin_names(key)
            if spec not in names:
                errors.append(f"{key}={spec!r} is not a registered name; {closest(spec, names)}; "
                              f"fix: one of them, or a plugin {FORMS}")
            continue
        try:
            _, _, n_pos, keywords = POINTS[key]
            check_in_child("mrl.plugin_checks:signature", [key, spec, n_pos, list(keywords)], key, [spec])
        except ValueError as e:
            errors.append(str(e))
    fn = cfg.reward.function
    if is_spec(fn):
        try:
            check_in_child("mrl.plugin_checks:signature", ["reward.function", fn, 0, list(REWARD_KEYWORDS)],
                           "reward.function", [fn])
        except ValueError as e:
            errors.append(str(e))
    else:
        from mrl.rewards.registry import reward_names
        if fn not in reward_names():
            errors.append(f"reward.function={fn!r} is not a registered scorer; {closest(fn, reward_names())}; "
                          f"fix: one of them, or a plugin {FORMS}")
