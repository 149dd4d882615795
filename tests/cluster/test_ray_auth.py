"""The local Ray instance of ``mrl train`` (``init_ray(None)``) listens on every interface of the host, so it
runs with Ray's token authentication and a per-run token kept in the environment: a client on the host (or
the network) without that token cannot join it and run code, and nothing is written to ``~/.ray``.
Subprocesses with their own HOME: this process's Ray and the user's home stay out of it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Starts mrl's local instance, then tries to join it from fresh processes: without a token, with a wrong
# one, and with the run's own token (which must work: the refusals are about the token, not the address).
_PROBE = r"""
import os, subprocess, sys
import ray
from mrl.cluster import init_ray
init_ray(None, num_cpus=1)
gcs = ray.get_runtime_context().gcs_address
print("MODE", os.environ["RAY_AUTH_MODE"], "TOKEN_LEN", len(os.environ["RAY_AUTH_TOKEN"]), flush=True)
join = f"import ray; ray.init(address={gcs!r}); print('JOINED', int(ray.cluster_resources()['CPU']))"
base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
base["RAY_gcs_server_port_wait_time_s"] = "2"  # a refused client gives up after 2 tries, not Ray's 20
for name, extra in (("none", {"RAY_AUTH_MODE": "disabled"}),
                    ("wrong", {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}),
                    ("run", {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.environ["RAY_AUTH_TOKEN"]})):
    r = subprocess.run([sys.executable, "-c", join], env={**base, **extra}, capture_output=True, text=True, timeout=120)
    print("JOIN", name, "JOINED 1" in r.stdout, flush=True)
ray.shutdown()
"""


@pytest.mark.slow
def test_local_instance_refuses_clients_without_the_runs_token(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=420, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("MODE", "JOIN"))]
    assert lines == ["MODE token TOKEN_LEN 64", "JOIN none False", "JOIN wrong False", "JOIN run True"], out.stdout
    assert not (tmp_path / ".ray").exists()  # the token lived only in the run's environment


def test_an_explicit_auth_mode_is_kept(monkeypatch) -> None:
    """RAY_AUTH_MODE set by the user (e.g. ``disabled`` on a trusted host) is respected: no token is made.
    ``ray.init`` is replaced, so no instance starts in this process."""
    import ray

    from mrl.cluster import worker_group

    calls = []
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    worker_group.init_ray(None, num_cpus=1)
    assert os.environ["RAY_AUTH_MODE"] == "disabled" and "RAY_AUTH_TOKEN" not in os.environ
    assert calls and calls[0]["address"] == "local"
