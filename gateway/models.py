"""``GET /v1/models`` entries as the engines describe their models.

An engine's own ``/v1/models`` entry (vLLM: ``id``, ``object``, ``created``,
``owned_by``, ``root``, ``max_model_len``, ``parent``, ``permission``) is read once per
engine start (:attr:`engines.pool.Engine.generation`) and kept; the gateway lists one
entry per model however many engines serve it. An engine that does not answer in
time, or does not list the model, leaves the minimal entry (``created``: the
gateway's start, ``owned_by``: ``sluice``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import aiohttp

from engines.pool import Engine

log = logging.getLogger(__name__)


class ModelCards:
    """The ``/v1/models`` entry of each served model.

    Args:
        session: the shared client session.
        started: the gateway's start, Unix seconds (the fallback ``created``).
        timeout_s: how long one engine's ``/v1/models`` may take, s.
    """

    def __init__(self, session: aiohttp.ClientSession, started: int, timeout_s: float) -> None:
        self.session = session
        self.started = started
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._cards: dict[tuple[str, int], dict[str, Any]] = {}

    def _minimal(self, model: str) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": self.started, "owned_by": "sluice"}

    async def card(self, model: str, engines: Sequence[Engine]) -> dict[str, Any]:
        """``model``'s entry, from the first of its ready ``engines`` that describes it."""
        for engine in engines:
            if not engine.routable:
                continue
            key = (engine.id, engine.generation)
            card = self._cards.get(key)
            if card is None:
                card = await self._fetch(engine)
                if card is None:
                    continue
                self._cards = {k: v for k, v in self._cards.items() if k[0] != engine.id}
                self._cards[key] = card
            return card
        return self._minimal(model)

    async def _fetch(self, engine: Engine) -> dict[str, Any] | None:
        try:
            async with self.session.get(f"{engine.base_url}/v1/models",
                                        timeout=self.timeout) as resp:
                if resp.status != 200:
                    return None
                body = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            log.debug("engine %s: /v1/models: %r", engine.id, e)
            return None
        for entry in (body.get("data") if isinstance(body, dict) else None) or ():
            if isinstance(entry, dict) and entry.get("id") == engine.model:
                return {**self._minimal(engine.model), **entry}
        return None
