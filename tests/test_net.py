"""mrl/net.py: loopback detection and free ports drawn outside the kernel's ephemeral range."""
from __future__ import annotations

import random
import socket

import pytest

from mrl import net


@pytest.mark.parametrize("host,want", [("localhost", True), ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True),
                                       ("0.0.0.0", False), ("10.0.0.5", False), ("node-1", False)])
def test_is_loopback(host: str, want: bool) -> None:
    assert net.is_loopback(host) is want


def test_free_ports_avoid_the_ephemeral_range_and_are_bindable() -> None:
    lo, hi = net.ephemeral_range()
    rng = random.Random(0)
    for _ in range(50):
        p = net.free_port(rng=rng)
        assert not lo <= p <= hi and p >= 20000, (p, lo, hi)
        with socket.socket() as s:  # free now: a bind without SO_REUSEADDR succeeds
            s.bind(("127.0.0.1", p))


def test_a_taken_port_is_skipped() -> None:
    """The first two draws are a port held by a listener: a later draw is returned, never the taken one.
    The later draws are random (a fixed one, 64000, was once held by another process of the suite)."""
    lo, hi = net.ephemeral_range()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        draws: list[int] = []

        class TakenFirst(random.Random):
            def randint(self, a: int, b: int) -> int:
                draws.append(taken if len(draws) < 2 else super().randint(a, b))
                return draws[-1]

        got = net.free_port(rng=TakenFirst(0))
    assert draws[:2] == [taken, taken] and len(draws) >= 3  # both taken draws were tried and skipped
    assert got == draws[-1] and got != taken and not lo <= got <= hi, (got, draws)


def test_unreadable_range_falls_back_to_linux_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(net, "_EPHEMERAL_FILE", tmp_path / "absent")
    assert net.ephemeral_range() == (32768, 60999)
    bad = tmp_path / "bad"
    bad.write_text("not numbers\n")
    monkeypatch.setattr(net, "_EPHEMERAL_FILE", bad)
    assert net.ephemeral_range() == (32768, 60999)
