"""Session set-up shared by every test: the directory of tests/helpers/asset_cache.py."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.helpers.asset_cache import ENV

_OWNER = pytest.StashKey[bool]()


def pytest_configure(config: pytest.Config) -> None:
    # made by the process that starts the session (pytest-xdist's controller, or a plain run) before any
    # worker starts: the workers inherit the variable and share the directory
    if not os.environ.get(ENV):
        os.environ[ENV] = tempfile.mkdtemp(prefix="mrl_test_assets_")
        config.stash[_OWNER] = True


def pytest_unconfigure(config: pytest.Config) -> None:
    if config.stash.get(_OWNER, False):
        shutil.rmtree(os.environ.pop(ENV), ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Files with slow tests (end-to-end runs, asset recipes) first: under pytest-xdist a long file handed out
    # last would leave the other worker idle at the end. Whole files move; the order inside a file is kept.
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)
