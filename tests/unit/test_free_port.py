"""Ports Sluice picks to listen on (``engines.process.free_port``, ``choose_port``):
outside the OS's ephemeral range, where outbound connections take their local port,
so no connection made meanwhile can take a picked port before its listener binds."""

from __future__ import annotations

import random
import socket

import pytest

from engines import process


def test_picks_below_the_ephemeral_range_and_bindable() -> None:
    low, _ = process._ephemeral_range()
    for seed in range(20):
        port = process.free_port(span=2, rng=random.Random(seed))
        assert port >= process.LOWEST_PICKED_PORT and port + 1 < low
        for p in (port, port + 1):
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))


class Draws(random.Random):
    """Draws the given ports in order (``randrange`` only)."""

    def __init__(self, ports: list[int]) -> None:
        super().__init__(0)
        self.ports = iter(ports)

    def randrange(self, *args, **kwargs) -> int:  # type: ignore[override]
        return next(self.ports)


def test_skips_a_bound_port_and_taken_ports() -> None:
    a, b, c = (process.free_port() for _ in range(3))
    with socket.socket() as held:
        held.bind(("127.0.0.1", a))
        held.listen()
        assert process.free_port(rng=Draws([a, b, c]), taken={b}) == c
        # span 2: P free but P + 1 bound is skipped
        assert process.free_port(span=2, rng=Draws([a - 1, c]), taken=set()) == c


def test_raises_when_nothing_is_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "_port_free", lambda host, port: False)
    with pytest.raises(OSError, match="no 1 free"):
        process.free_port()


def test_choose_port_prefers_the_configured_range() -> None:
    first = process.free_port(span=3)
    assert process.choose_port("127.0.0.1", (first, first + 2), {first}) == first + 1
    # a full range: a picked port outside the ephemeral range instead
    port = process.choose_port("127.0.0.1", (first, first), {first})
    assert port != first and port < process._ephemeral_range()[0]
