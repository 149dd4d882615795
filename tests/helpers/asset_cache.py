"""Test assets built once per test session and copied by every test that needs them.

The quickstarts' tiny models take seconds to minutes of CPU to write (a warm start is a training run), and
several test files need the same ones. ``cached(name, build)`` builds ``name`` once per ``make test`` —
across pytest-xdist's worker processes too: a file lock makes the second worker wait for the first one's
build instead of repeating it — and returns its directory, which callers copy and never change. The
session's cache directory is made when the session starts (tests/conftest.py) and removed when it ends.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

ENV = "MRL_TEST_ASSET_CACHE"


def cache_root() -> Path:
    """The session's cache directory: made by the first process that asks (tests/conftest.py, in the process
    that starts the session) and removed when that process exits; its child processes inherit it."""
    if not os.environ.get(ENV):
        os.environ[ENV] = tempfile.mkdtemp(prefix="mrl_test_assets_")
        atexit.register(shutil.rmtree, os.environ[ENV], True)
    return Path(os.environ[ENV])


def cached(name: str, build: Callable[[Path], object], timeout_s: float = 1800) -> Path:
    """``root/name`` after ``build(root/name)`` ran once in this session; a build that raised is retried by
    the next caller (only a finished build is marked done)."""
    root = cache_root()
    out, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock"), timeout=timeout_s):
        if not done.is_file():
            shutil.rmtree(out, ignore_errors=True)
            build(out)
            done.touch()
    return out


def copy_of(name: str, build: Callable[[Path], object], dest: Path) -> Path:
    """A private copy of the cached ``name`` at ``dest`` (the test may change it)."""
    shutil.copytree(cached(name, build), dest)
    return dest
