"""Built-in router selection rules (no network): least outstanding, affinity, exclusions,
and the sglang_router option."""
import pytest

from mrl.rollout import sglang_router
from mrl.rollout.pool import EngineEndpoint, EnginePool
from mrl.rollout.router import build_sglang_router_command, make_router


@pytest.fixture
def pool():
    p = EnginePool([EngineEndpoint(f"http://127.0.0.1:{9000 + i}/") for i in range(3)], health_interval_s=0)
    yield p
    p.close()


def test_least_outstanding_affinity_and_exclusion(pool):
    a, b, c = pool.engines
    assert a.url == "http://127.0.0.1:9000"  # trailing slash dropped
    a.outstanding, b.outstanding, c.outstanding = 2, 0, 1
    r = make_router(pool)
    assert r.pick() is b
    assert r.pick("p0") is b
    b.outstanding = 5  # busier now, but the prompt's other samples stay on b
    assert r.pick("p0") is b and r.pick("p1") is c
    b.healthy = False  # affinity yields to health
    assert r.pick("p0") is c
    assert r.pick(exclude=[c]) is a
    r.forget("p0")
    assert "p0" not in r._affinity
    for e in pool.engines:
        e.healthy = False
    assert r.pick() is None


def test_sglang_router_option(pool, monkeypatch):
    cmd = build_sglang_router_command(["http://h:1", "http://h:2"], 31000, python="py")
    assert cmd[:3] == ["py", "-m", "sglang_router.launch_router"]
    assert cmd[cmd.index("--worker-urls") + 1:cmd.index("--worker-urls") + 3] == ["http://h:1", "http://h:2"]
    monkeypatch.setattr(sglang_router, "sglang_router_available", lambda: False)
    with pytest.raises(RuntimeError, match="pip install sglang-router"):
        sglang_router.SGLangRouter(["http://h:1"], 31000, "/nonexistent/router.log")
    with pytest.raises(ValueError, match="rollout.router must be"):
        make_router(pool, "round_robin")
