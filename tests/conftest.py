"""Session set-up shared by every test: the directory of tests/helpers/asset_cache.py."""
from __future__ import annotations

import pytest

from tests.helpers.asset_cache import cache_root


def pytest_configure(config: pytest.Config) -> None:
    # made (and removed at exit) by the process that starts the session, pytest-xdist's controller or a plain
    # run, before any worker starts: the workers inherit its variable and share the directory
    cache_root()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Files with slow tests (end-to-end runs, asset recipes) first: under pytest-xdist a long file handed out
    # last would leave the other worker idle at the end. Whole files move; the order inside a file is kept.
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)
