"""Sticky sessions: the engine each client conversation (``x-session-id``) was last
sent to, so its next turn can go there too (docs/architecture.md, "Engines")."""

from __future__ import annotations

from collections import OrderedDict
from hashlib import blake2b

from engines.pool import Engine


def session_key(tenant: str, session_id: str | None) -> str | None:
    """The table's key for a tenant's ``x-session-id``: 32 hex characters (BLAKE2b,
    16 bytes) of the tenant and the id, so an entry's size does not depend on what the
    client sends (a header may be 8 KiB) and two tenants' equal ids are two sessions.
    None when the client sent no id."""
    if not session_id:
        return None
    return blake2b(f"{tenant}\0{session_id}".encode(), digest_size=16).hexdigest()


class SessionTable:
    """Bounded LRU map session id → (engine id, engine generation, last use).

    A session's engine is forgotten when the engine restarts (its cache is gone),
    after ``ttl_s`` without a request, or when ``max_sessions`` newer sessions push it
    out. Lookup only names the engine; the ``session-affinity`` scorer prefers it if
    it is still a candidate (not saturated, not draining), so a saturated engine
    makes the session fall back to normal routing — and the session then sticks to
    its new engine.

    Args:
        max_sessions: most sessions remembered (default 100,000; ~200 B each).
        ttl_s: idle time after which a session is forgotten, s (default 1800).
    """

    def __init__(self, max_sessions: int = 100_000, ttl_s: float = 1800.0) -> None:
        if max_sessions < 1 or ttl_s <= 0:
            raise ValueError("need max_sessions >= 1 and ttl_s > 0")
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._table: OrderedDict[str, tuple[str, int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def engine_for(self, session_id: str | None, engines: list[Engine] | tuple[Engine, ...],
                   now: float) -> str | None:
        """The id of the session's engine if it is among ``engines`` with the same
        generation and the entry is fresh; else None."""
        if not session_id:
            return None
        entry = self._table.get(session_id)
        if entry is None:
            return None
        engine_id, generation, at = entry
        if now - at > self.ttl_s:
            del self._table[session_id]
            return None
        for e in engines:
            if e.id == engine_id:
                return engine_id if e.generation == generation else None
        return None

    def record(self, session_id: str | None, engine: Engine, now: float) -> None:
        """The session's latest request went to ``engine``."""
        if not session_id:
            return
        self._table[session_id] = (engine.id, engine.generation, now)
        self._table.move_to_end(session_id)
        while len(self._table) > self.max_sessions:
            self._table.popitem(last=False)
