"""The engine address file: how gateway processes that do not launch the engines find
the ones another process launched.

With ``sluice serve --workers N`` one worker launches and supervises the engines and
writes, once their addresses are assigned, one JSON object mapping each engine id to its
address: ``{"<id>": {"base_url": "http://host:port", "kv_events": {"endpoint": …,
"replay": … | null, "topic": …} | null}}``. The other workers read it and treat those
engines as ``external`` ones at that address (probed, scraped, KV events followed).
The file is replaced atomically (``os.replace``), so a reader never sees half of it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from engines.kv_events import EventsEndpoint
from engines.pool import Engine


@dataclass(frozen=True)
class EngineAddress:
    """Where one launched engine answers: ``base_url`` (``http://host:port``, no
    ``/v1``) and its KV-event endpoint, if it publishes events."""

    base_url: str
    kv_events: EventsEndpoint | None = None


def write_addresses(path: Path, engines: Iterable[Engine]) -> None:
    """Write the address of each of ``engines`` to ``path``, replacing the file
    atomically.

    Raises:
        OSError: the folder is not writable.
    """
    table = {e.id: {"base_url": e.base_url,
                    "kv_events": asdict(e.kv_events) if e.kv_events else None}
             for e in engines}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(table))
    os.replace(tmp, path)


def read_addresses(path: Path) -> dict[str, EngineAddress]:
    """The table :func:`write_addresses` wrote, by engine id.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not such a table.
    """
    table = json.loads(path.read_text())
    try:
        return {engine_id: EngineAddress(
                    entry["base_url"],
                    EventsEndpoint(**entry["kv_events"]) if entry["kv_events"] else None)
                for engine_id, entry in table.items()}
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not an engine address table: {e!r}") from e
