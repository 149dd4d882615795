"""Import SGLang's own code (the pinned release, requirements-sglang-cpu.txt) on a CPU host.

`make install` puts the sglang wheel and the few modules its import chain needs into
``.venv/sglang-cpu`` with ``--no-deps`` (SGLang's declared dependencies would pull CUDA builds).
Tests that need it call ``require()``, which makes the top-level packages of that directory
importable and returns ``sglang``; it fails (never skips) when the install is missing, so a broken
install cannot turn the conformance suite green. The directory is reached through a finder on
``sys.meta_path`` rather than ``sys.path``: multiprocessing children copy ``sys.path`` (not the
finders), and code there must not find this torchvision copy (transformers would import it).

One adjustment, outside SGLang: ``sglang.srt.configs`` imports ``torchvision.transforms`` (image
models), and PyPI's torchvision is a CUDA build whose C extension cannot load beside the CPU torch
wheel; torchvision then fails at import registering a fake kernel for ``torchvision::nms``. We
declare the schemas of the two operators it registers fakes for, so its pure-Python transforms
import. No torchvision operator runs on any path these tests exercise (calling one would raise).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from pathlib import Path
from types import ModuleType

SGLANG_DIR = Path(sys.prefix) / "sglang-cpu"


def _declare_torchvision_ops() -> None:
    import torch

    for name, schema in (("nms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"),
                         ("qnms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")):
        try:
            torch.library.define(f"torchvision::{name}", schema)
        except RuntimeError:  # already declared (by the real extension or an earlier call)
            pass


class _TopLevelFinder(importlib.abc.MetaPathFinder):
    """Finds only the top-level packages installed in SGLANG_DIR; submodules follow their
    package's ``__path__`` as usual."""

    def __init__(self) -> None:
        self.names = {p.name.removesuffix(".py") for p in SGLANG_DIR.iterdir()
                      if not p.name.endswith((".dist-info", ".libs")) and p.name not in ("bin", "__pycache__")}

    def find_spec(self, fullname, path=None, target=None):
        if "." in fullname or fullname not in self.names:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [str(SGLANG_DIR)])


def require() -> ModuleType:
    """The ``sglang`` package from ``.venv/sglang-cpu``; raises with the fix when absent."""
    if not (SGLANG_DIR / "sglang").is_dir():
        raise RuntimeError(f"SGLang's code is not installed in {SGLANG_DIR}: run `make install` "
                           "(it installs requirements-sglang-cpu.txt with --no-deps there)")
    if not any(isinstance(f, _TopLevelFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TopLevelFinder())
    _declare_torchvision_ops()
    mod = importlib.import_module("sglang")
    if not str(getattr(mod, "__file__", "")).startswith(str(SGLANG_DIR)):
        raise RuntimeError(f"imported sglang from {mod.__file__}, expected the pinned copy in {SGLANG_DIR}")
    return mod
