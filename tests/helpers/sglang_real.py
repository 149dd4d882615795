"""Import SGLang's own code (the pinned release, requirements-sglang-cpu.txt) on a CPU host.

`make install` puts the sglang wheel and the few modules its import chain needs into
``.venv/sglang-cpu`` with ``--no-deps`` (SGLang's declared dependencies would pull CUDA builds).
``load()`` puts that directory on ``sys.path`` and returns the ``sglang`` package; tests that
need it call ``require()``, which fails (never skips) when
the install is missing, so a broken install cannot turn the conformance suite green.

One adjustment, outside SGLang: ``sglang.srt.configs`` imports ``torchvision.transforms`` (image
models), and PyPI's torchvision is a CUDA build whose C extension cannot load beside the CPU torch
wheel; torchvision then fails at import registering a fake kernel for ``torchvision::nms``. We
declare the schemas of the two operators it registers fakes for, so its pure-Python transforms
import. No torchvision operator runs on any path these tests exercise (calling one would raise).
"""
from __future__ import annotations

import importlib
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


def require() -> ModuleType:
    """The ``sglang`` package from ``.venv/sglang-cpu``; raises with the fix when absent."""
    if not (SGLANG_DIR / "sglang").is_dir():
        raise RuntimeError(f"SGLang's code is not installed in {SGLANG_DIR}: run `make install` "
                           "(it installs requirements-sglang-cpu.txt with --no-deps there)")
    if str(SGLANG_DIR) not in sys.path:
        sys.path.insert(0, str(SGLANG_DIR))
    _declare_torchvision_ops()
    mod = importlib.import_module("sglang")
    if not str(getattr(mod, "__file__", "")).startswith(str(SGLANG_DIR)):
        raise RuntimeError(f"imported sglang from {mod.__file__}, expected the pinned copy in {SGLANG_DIR}")
    return mod
