"""Test helpers shared by every suite: a hand-driven :class:`~limits.interfaces.Clock`
and :func:`wait_for`, the one way a test waits for something to happen."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

import aiohttp

#: Seconds between two checks of a :func:`wait_for` predicate.
POLL_S = 0.01
#: Checks :func:`wait_for` makes after single event-loop iterations before it starts
#: waiting ``poll_s`` between checks (what other tasks do next is seen at once).
SPIN_CHECKS = 20


class ManualClock:
    """A :class:`~limits.interfaces.Clock` that moves only when told: ``t`` is the
    time (s); ``step`` (s) is added on every read, for a clock that moves by itself."""

    def __init__(self, t: float = 1000.0, step: float = 0.0) -> None:
        self.t, self.step = t, step

    def now(self) -> float:
        self.t += self.step
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


async def wait_for(predicate: Callable[[], bool | Awaitable[bool]], timeout_s: float = 5.0,
                   what: str = "the condition", poll_s: float = POLL_S) -> None:
    """Return as soon as ``predicate()`` (plain or async) is true: checked after each
    of the next :data:`SPIN_CHECKS` event-loop iterations, then every ``poll_s`` s
    (default :data:`POLL_S`; longer where each check sends a request).

    Raises:
        AssertionError: still false after ``timeout_s`` seconds (names ``what``).
    """
    deadline = time.monotonic() + timeout_s
    checks = 0
    while True:
        ok = predicate()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        checks += 1
        await asyncio.sleep(0 if checks <= SPIN_CHECKS else poll_s)


def wait_for_sync(predicate: Callable[[], bool], timeout_s: float = 10.0,
                  what: str = "the condition") -> None:
    """:func:`wait_for` for code without an event loop (session fixtures, threads)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(POLL_S)


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """``name{labels}`` → value of the Prometheus text page at ``url/metrics``."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
