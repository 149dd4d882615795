"""Session set-up shared by every test: the directory of tests/helpers/asset_cache.py and the session's Ray
instance (tests/helpers/ray_cluster.py)."""
from __future__ import annotations

import os
from pathlib import Path

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


# The first files handed out to the two workers must not both need a cached asset that neither has built yet
# (tests/helpers/asset_cache.py): the second would wait idle for the first one's build. In collection order
# the agent's end-to-end test and its loop tests came first and both waited on the agent's warm start (~30 s
# of one core idle at the start of `make test`, 2026-11-28). So the longest file, the RM recipe, goes first
# and the agent loop tests after the other slow files (the asset is built by then).
FIRST = ("quickstarts/test_rm_assets.py",)
LAST_OF_SLOW = ("agent/test_loop.py",)


def _order(path: Path, slow: set[Path], multirank: set[Path]) -> int:
    name = path.relative_to(Path(__file__).parent).as_posix()
    if name in FIRST:
        return 0
    if path in slow:
        return 2 if name in LAST_OF_SLOW else 1
    return 3 if path in multirank else 4


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Files with slow tests (end-to-end runs, asset recipes) first, then the other multi-rank files (5-60 s
    # each), then the rest: under pytest-xdist a long file handed out last leaves the other worker idle at the
    # end (tests/workers/test_moe_actor.py, 17 s, came last in collection order). Whole files move; the order
    # inside a file is kept.
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    multirank = {item.path for item in items if item.get_closest_marker("multirank")}
    items.sort(key=lambda item: _order(item.path, slow, multirank))
