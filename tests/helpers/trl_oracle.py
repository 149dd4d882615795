"""Import TRL's own code (the pinned release, requirements-oracles.txt) as the oracle of
tests/workers/test_trl_loss.py.

`make install` puts TRL, datasets and datasets' two compiled/pure-Python helpers (xxhash,
multiprocess) into ``.venv/oracles`` with ``--no-deps``, next to verl (tests/helpers/verl_oracle.py);
their other dependencies (accelerate, transformers, pyarrow, pandas, dill, fsspec, huggingface_hub)
are the venv's own. ``require()`` makes exactly those top-level packages importable through a finder
on ``sys.meta_path`` (the directory also holds verl's ``tests``/``scripts`` packages, which must not
shadow ours) and returns ``trl``. ``check_installed()`` and ``require()`` fail, never skip, when the
install is missing or is not the pinned release, so a broken install cannot turn the test green.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import re
import sys
from pathlib import Path
from types import ModuleType

from tests.helpers.verl_oracle import ORACLE_DIR

REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements-oracles.txt"
#: The only top-level names served from ORACLE_DIR by this finder, and the distributions whose metadata it
#: serves (``importlib.metadata.version("trl")``: TRL's ``__version__``, transformers' availability checks).
TOP_LEVEL = ("trl", "datasets", "xxhash", "multiprocess", "_multiprocess")
DISTRIBUTIONS = ("trl", "datasets", "xxhash", "multiprocess")


def pinned_version() -> str:
    m = re.search(r"^trl==(\S+)", REQUIREMENTS.read_text(), re.MULTILINE)
    if m is None:
        raise RuntimeError(f"{REQUIREMENTS} pins no trl release")
    return m.group(1)


def check_installed() -> str:
    """The pinned version, after checking (without importing) that ``.venv/oracles`` holds it."""
    version = pinned_version()
    if not (ORACLE_DIR / "trl" / "__init__.py").exists():
        raise RuntimeError(f"TRL is not installed in {ORACLE_DIR}: run `make install` "
                           "(it installs requirements-oracles.txt with --no-deps there)")
    if not (ORACLE_DIR / f"trl-{version}.dist-info").is_dir():
        found = sorted(p.name for p in ORACLE_DIR.glob("trl-*.dist-info"))
        raise RuntimeError(f"{ORACLE_DIR} holds {found}, not trl {version} (requirements-oracles.txt): "
                           "run `make install`")
    return version


class _TrlFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if "." in fullname or fullname not in TOP_LEVEL:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [str(ORACLE_DIR)])

    def find_distributions(self, context=None):
        if context is None or context.name is None or context.name.lower().replace("_", "-") not in DISTRIBUTIONS:
            return iter(())
        ctx = importlib.metadata.DistributionFinder.Context(name=context.name, path=[str(ORACLE_DIR)])
        return importlib.metadata.MetadataPathFinder.find_distributions(ctx)


def require() -> ModuleType:
    """``trl`` from ``.venv/oracles`` (the pinned release)."""
    version = check_installed()
    if not any(isinstance(f, _TrlFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TrlFinder())
    trl = importlib.import_module("trl")
    if not str(trl.__file__).startswith(str(ORACLE_DIR)) or trl.__version__ != version:
        raise RuntimeError(f"imported trl {trl.__version__} from {trl.__file__}, "
                           f"expected the pinned {version} in {ORACLE_DIR}")
    return trl
