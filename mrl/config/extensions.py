"""Extension points from config: the field type of a function-naming key and its ``mrl plan`` check.

``algorithm.adv_estimator``, ``actor.policy_loss``, ``data.sampler.class_path`` and ``reward.function``
take a registry name or a
plugin spec (``pkg.module:fn`` / ``path/to/file.py:fn``, see ``mrl.plugins`` and docs/plugins.md).
The registries are the only list of names: a bare name is checked against the names the built-in
modules register (read from their source, so this stays free of torch), a plugin is imported and
its signature checked against the call mrl makes. Every miss is one error naming the key, what was
tried and the closest valid names.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from pydantic import AfterValidator

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

_SPEC_RE = re.compile(r"^([A-Za-z_][\w]*|[A-Za-z_][\w.]*:[A-Za-z_]\w*|[^:]+\.py:[A-Za-z_]\w*)$")


def _syntax(v: str) -> str:
    if not _SPEC_RE.match(v):
        raise ValueError(f"{v!r} is not {FORMS}; fix: e.g. a built-in name, or my_plugins.py:my_fn")
    target, _, attr = v.rpartition(":")
    # Workers (Ray actors) may start in another directory: a relative plugin file is pinned to the
    # directory the config was loaded from, and `mrl plan` shows the absolute path it will import.
    if target.endswith(".py") and not Path(target).is_absolute():
        return f"{Path(target).resolve()}:{attr}"
    return v


PluginSpec = Annotated[str, AfterValidator(_syntax)]

# key -> (registry's built-in module, its decorator, positional args, keywords mrl passes)
_ADV_KW = ("index", "values", "reward_baselines", "gamma", "lam", "norm_adv_by_std_in_grpo")
_LOSS_KW = ("loss_agg_mode", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "rollout_log_probs",
            "tis_imp_ratio_cap", "global_tokens", "global_seqs", "norm_constant", "rollout_is_weights", "loss_params")
POINTS = {
    "algorithm.adv_estimator": ("algorithms/advantages.py", "register_adv_est", 2, _ADV_KW),
    "actor.policy_loss": ("algorithms/policy_loss.py", "register_policy_loss", 4, _LOSS_KW),
    "data.sampler.class_path": ("data/sampler.py", "register_sampler", 2, ("shuffle", "seed", "dataset")),
}


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
