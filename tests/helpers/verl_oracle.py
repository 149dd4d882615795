"""Import verl's own code (the pinned release, requirements-oracles.txt) as the oracle of
tests/algorithms/oracle/.

`make install` puts verl and the few pure-Python modules the import chain of
``verl.trainer.ppo.core_algos`` / ``rollout_corr_helper`` needs into ``.venv/oracles`` with
``--no-deps`` (verl's declared dependencies would pull vLLM and CUDA builds). ``require()`` makes
exactly those top-level packages importable through a finder on ``sys.meta_path`` (not
``sys.path``: the directory also holds verl's ``tests``/``scripts`` packages, which must not shadow
ours, and nothing else may pick up these copies) and returns the two verl modules. It fails, never
skips, when the install is missing, so a broken install cannot turn the oracle suite green.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import sys
from pathlib import Path
from types import ModuleType

ORACLE_DIR = Path(sys.prefix) / "oracles"
#: The only top-level names served from ORACLE_DIR (verl and its import chain's pure-Python deps).
TOP_LEVEL = ("verl", "omegaconf", "antlr4", "tensordict", "pyvers", "codetiming")


#: Served names the venv also has, at another version: antlr4 (omegaconf's parser needs 4.9.3, the
#: venv's latex2sympy2_extended — math-verify's parser — needs 4.13). The oracle's copy is private to
#: verl's import: taken out of ``sys.modules`` afterwards (omegaconf keeps its references) and the
#: finder no longer serves it, so a later ``import antlr4`` anywhere gets the venv's.
SHADOWED = ("antlr4",)
_served = set(TOP_LEVEL)


@contextlib.contextmanager
def _private(names: tuple[str, ...]):
    def owned(mod: str) -> bool:
        return any(mod == n or mod.startswith(n + ".") for n in names)

    before = {k: v for k, v in sys.modules.items() if owned(k)}
    for k in before:
        del sys.modules[k]
    try:
        yield
    finally:
        for k in [k for k in sys.modules if owned(k)]:
            del sys.modules[k]
        sys.modules.update(before)
        _served.difference_update(names)


class _OracleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if "." in fullname or fullname not in _served:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [str(ORACLE_DIR)])


def require() -> tuple[ModuleType, ModuleType]:
    """``(verl.trainer.ppo.core_algos, verl.trainer.ppo.rollout_corr_helper)`` from ``.venv/oracles``."""
    if not (ORACLE_DIR / "verl").is_dir():
        raise RuntimeError(f"verl's code is not installed in {ORACLE_DIR}: run `make install` "
                           "(it installs requirements-oracles.txt with --no-deps there)")
    if not any(isinstance(f, _OracleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _OracleFinder())
    with _private(SHADOWED):
        core = importlib.import_module("verl.trainer.ppo.core_algos")
        corr = importlib.import_module("verl.trainer.ppo.rollout_corr_helper")
        importlib.import_module("verl.workers.config.actor")  # actor_config's import, while the copies are served
    if not str(core.__file__).startswith(str(ORACLE_DIR)):
        raise RuntimeError(f"imported verl from {core.__file__}, expected the pinned copy in {ORACLE_DIR}")
    return core, corr


def actor_config(**kw):
    """verl's ``ActorConfig`` for a policy-loss call (``strategy`` is required by verl; local
    denominators: ``global_batch_info`` empty)."""
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    pl = {k: kw.pop(k) for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")
          if k in kw}
    mode = kw.pop("loss_mode", "vanilla")
    info = {"loss_scale_factor": kw.pop("loss_scale_factor")} if "loss_scale_factor" in kw else {}
    cfg = ActorConfig(strategy="megatron", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                      policy_loss=PolicyLossConfig(loss_mode=mode, **pl), **kw)
    cfg.global_batch_info.update(info)
    return cfg
