"""Session set-up shared by every test: the directory of tests/helpers/asset_cache.py and the session's Ray
instance (tests/helpers/ray_cluster.py)."""
from __future__ import annotations

import os

import pytest

from tests.helpers.asset_cache import cache_root
from tests.helpers.ray_cluster import SESSION_PID, stop_session_ray


def _starts_the_session(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")  # pytest-xdist's controller, or a plain run; not a worker


def pytest_configure(config: pytest.Config) -> None:
    # made (and removed at exit) by the process that starts the session, pytest-xdist's controller or a plain
    # run, before any worker starts: the workers inherit its variables and share the directory
    cache_root()
    if _starts_the_session(config):
        os.environ[SESSION_PID] = str(os.getpid())  # the shared Ray instance lives while this process does


def pytest_unconfigure(config: pytest.Config) -> None:
    if _starts_the_session(config):
        stop_session_ray()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Files with slow tests (end-to-end runs, asset recipes) first: under pytest-xdist a long file handed out
    # last would leave the other worker idle at the end. Whole files move; the order inside a file is kept.
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)
