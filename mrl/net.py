"""Two network facts several layers need, in one place (standard library only): whether a bind
address is loopback, and a free TCP port."""
from __future__ import annotations

import ipaddress
import random
import socket
from pathlib import Path

_EPHEMERAL_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_EPHEMERAL_DEFAULT = (32768, 60999)  # Linux's default
_PORT_MIN = 20000  # Ray's worker ports end at 19999 (min/max_worker_port), its GCS/dashboard sit lower


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP (127.0.0.0/8, ::1): reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (where every ``bind(0)`` and outgoing connection lands)."""
    try:
        lo, hi = (int(x) for x in _EPHEMERAL_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A TCP port free on ``host`` now, drawn outside the kernel's ephemeral range when it can be.

    Why not the OS's choice (``bind(0)``): such a port comes from the ephemeral range, which the kernel
    keeps handing out to every connection and ``bind(0)`` on the host (gloo's pairs, Ray's workers,
    other runs) between this check and the caller's own bind. A test suite running two trainings side
    by side saw rank 0's TCPStore fail with EADDRINUSE on a MASTER_PORT drawn that way. Above the
    ephemeral range (61000-65535 on Linux) only explicit binds compete; below it sit the engines'
    ``rollout.port_base`` (30000 by default), so that side is the fallback."""
    rng = rng or random.SystemRandom()
    lo, hi = ephemeral_range()
    above, below = (hi + 1, 65535), (_PORT_MIN, lo - 1)
    spans = [r for r in (above, below) if r[1] - r[0] >= 256]
    for a, b in spans:
        for _ in range(64):
            port = rng.randint(a, b)
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((host, port))
                return port
            except OSError:
                continue
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # every draw taken: the OS's choice
        s.bind((host, 0))
        return int(s.getsockname()[1])
