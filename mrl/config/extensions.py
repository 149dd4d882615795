"""Extension points from config: the field type of a function-naming key (its ``mrl plan`` check: validate_extensions.py).

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
from typing import Annotated

from pydantic import AfterValidator

from mrl.plugins import (
    FORMS,
)

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






