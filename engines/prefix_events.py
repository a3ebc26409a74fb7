"""The precise prefix index: what each engine's prefix cache holds, from its KV
events (:mod:`engines.kv_events`), in the gateway's own block keys.

An engine's block hashes depend on its hash function and seed (vLLM:
``--prefix-caching-hash-algo``, ``PYTHONHASHSEED``), so they are never compared with
the gateway's. Each ``BlockStored`` carries the blocks' token ids and its parent's
hash; the index continues the gateway's own chain
(:func:`engines.blocks.chain_block_hashes`) from the parent's key over those tokens,
so every engine block maps to the gateway keys of the prompt blocks it completes —
also when the gateway's block size differs from the engine's. The ``cache_salt`` the
engine hashed into the first block comes back in that block's ``extra_keys`` and
salts the chain's root, as the gateway salts its own.

Hybrid models keep one KV-cache group per attention type (Gemma 3: full-attention
and sliding-window layers), and vLLM publishes each group's stores and removals
with its ``group_idx`` and the *same* block hashes. A sliding-window group holds
only the blocks inside its window: its ``BlockStored`` lists fewer hashes than the
token ids cover (out-of-window blocks are null, ``cache_full_blocks`` skips them)
and it removes blocks the full-attention group keeps. The index therefore keeps
each group apart and, once a group shows a partial store, drops it: a prefix hit
needs the whole prefix in the full-attention group(s).

Matching (:meth:`EventPrefixIndex.match`) counts the longest run of the prompt's
blocks held (by every full group), from the start, as vLLM's
``find_longest_cache_hit`` does. Two other indexes complete it:

* a short-lived *predicted-on-route* index (:class:`~engines.prefix.PrefixIndex`
  with ``predicted_ttl_s``): a request just routed is not yet in the engine's
  cache (its blocks are stored when its prefill is scheduled), so siblings routed
  meanwhile must still see it; the match is the larger of the two;
* the approximate index (:class:`~engines.prefix.PrefixIndex`, routing history),
  used for an engine whose events are not synced (no subscriber, a loss being
  rebuilt, publisher gone), and completing the match of an engine whose blocks the
  index has dropped while the engine still holds them (:attr:`_EngineCache.lossy`:
  the memory cap trimmed them, or a stored block's parent was unknown): the match
  is then the larger of the two. Without it, once the engines' caches outgrew the
  cap the index forgot their oldest conversations' turns, and every later block
  stored on them was unanchored: on the Mooncake trace (1,000 requests, at least
  690k engine blocks stored against 419k entries at the benchmark's 512 MiB) the
  index's recall fell to 0.62 (issue 44), where the approximate index read 0.95.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from engines.blocks import chain_block_hashes
from engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Event, ExternalBlockHash
from engines.pool import Engine
from engines.prefix import PrefixIndex

#: Bytes one precise entry may cost in CPython 3.11: an ``OrderedDict`` slot for the
#: engine hash (int), its ``_Block`` (slots: keys tuple, tail, pending, salt, count)
#: and the gateway key's slot and count in a ``dict``. Measured with ``tracemalloc``
#: in ``tests/unit/test_prefix_events.py``: 320–440 B at caps of 4–16 MiB; rounded up.
EVENT_ENTRY_BYTES = 640

_EMPTY: tuple[int, ...] = ()


@dataclass(slots=True)
class _Block:
    """One engine block: the gateway keys of the prompt blocks whose last token it
    holds, and the chain state at its end (``tail``: the last gateway key completed
    at or before it, None at the root; ``pending``: tokens after ``tail``; ``salt``
    while still at the root) to continue from when a child is stored."""

    keys: tuple[int, ...]
    tail: int | None
    pending: tuple[int, ...]
    salt: str | None
    count: int = 1  # stores minus removals of this hash (vLLM may hold it in 2 blocks)


@dataclass
class _Group:
    """One KV-cache group's blocks (engine hash → block) and gateway keys held."""

    blocks: OrderedDict[ExternalBlockHash, _Block] = field(default_factory=OrderedDict)
    keys: dict[int, int] = field(default_factory=dict)  # gateway key -> engine blocks


@dataclass
class _EngineCache:
    generation: int
    synced: bool = False
    groups: dict[int | None, _Group] = field(default_factory=dict)
    partial: set[int | None] = field(default_factory=set)  # sliding-window groups
    #: the index dropped blocks the engine may still hold (the memory cap trimmed
    #: them, or a stored block's parent was unknown) since its cache was last empty
    lossy: bool = False

    def full_groups(self) -> list[_Group]:
        return [g for gid, g in self.groups.items() if gid not in self.partial]


def event_salt(ev: BlockStored) -> str | None:
    """The ``cache_salt`` hashed into the first stored block: in vLLM's untagged
    ``extra_keys`` (``to_event_extra_keys`` in ``vllm/v1/core/kv_cache_utils.py``) the
    first block's entry lists the LoRA name (when ``lora_name`` is set), multimodal
    ``(id, offset)`` pairs, then the salt string, then prompt-embedding digests
    (bytes)."""
    if ev.parent_block_hash is not None or not ev.extra_keys or not ev.extra_keys[0]:
        return None
    strings = [k for k in ev.extra_keys[0] if isinstance(k, str)]
    if ev.lora_name is not None:
        strings = strings[1:]
    return strings[0] if strings else None


class EventPrefixIndex:
    """Per engine, the gateway keys of the blocks its prefix cache holds (see module
    doc). Same interface as :class:`~engines.prefix.PrefixIndex` for the scheduler
    (:meth:`match`, :meth:`record`, :meth:`forget`) plus the
    :class:`~engines.kv_events.KVEventSink` methods the subscribers call.

    Memory: the precise entries get half of ``max_bytes``
    (``EVENT_ENTRY_BYTES`` each; past the cap the engine with the most entries loses
    its oldest-stored blocks — usually its least recent, which its own LRU evicts
    first — and its matches are completed by the approximate index from then on),
    the approximate index the other half, less the predicted index's
    ``max_bytes / 16``. An engine's entries also stay within its KV cache: the engine
    reports every eviction.

    Args:
        max_bytes: memory cap, bytes.
        ttl_s: the approximate index's entry lifetime, s.
        predicted_ttl_s: how long a routed request's blocks count as held before the
            engine reports them, s.
        block_size: the gateway's block size when configured
            (``scheduler.prefix.block_size``); None: the engine's (each event's).
    """

    def __init__(self, max_bytes: int = 64 << 20, ttl_s: float = 600.0,
                 predicted_ttl_s: float = 10.0, block_size: int | None = None) -> None:
        self.max_entries = max(1, max_bytes // 2 // EVENT_ENTRY_BYTES)
        self.approximate = PrefixIndex(max(max_bytes // 2 - max_bytes // 16, 1024), ttl_s)
        self.predicted = PrefixIndex(max(max_bytes // 16, 1024), predicted_ttl_s)
        self.block_size = block_size
        self._engines: dict[str, _EngineCache] = {}
        self._total = 0
        #: Stored events whose parent block was unknown (their blocks are skipped).
        self.unanchored = 0

    def __len__(self) -> int:
        """Precise entries (engine blocks) over all engines."""
        return self._total

    def entries(self, engine_id: str) -> int:
        """Precise entries of ``engine_id`` (engine blocks, all groups)."""
        c = self._engines.get(engine_id)
        return sum(len(g.blocks) for g in c.groups.values()) if c else 0

    def synced(self, engine: Engine) -> bool:
        c = self._engines.get(engine.id)
        return c is not None and c.synced and c.generation == engine.generation

    # ---------------------------------------------------------------- scheduler

    def match(self, engine: Engine, blocks: Sequence[int], now: float) -> int:
        """Leading ``blocks`` ``engine`` holds: from its events (or routed there in
        the last ``predicted_ttl_s``) when synced, else the approximate index's
        answer; the larger of the two while the index has dropped blocks the engine
        may still hold (module docstring)."""
        c = self._cache(engine)
        if c is None or not c.synced:
            return self.approximate.match(engine, blocks, now)
        if c.lossy:
            return max(self._precise(c, engine, blocks, now),
                       self.approximate.match(engine, blocks, now))
        return self._precise(c, engine, blocks, now)

    def lossy(self, engine: Engine) -> bool:
        """Whether the index has dropped blocks ``engine`` may still hold since its
        cache was last empty (its matches then take the approximate index's where
        larger)."""
        c = self._engines.get(engine.id)
        return c is not None and c.lossy

    def _precise(self, c: _EngineCache, engine: Engine, blocks: Sequence[int],
                 now: float) -> int:
        """The match from ``engine``'s events and the predicted-on-route index."""
        held = [g.keys for g in c.full_groups()]
        n = 0
        if held:
            for h in blocks:
                if not all(h in keys for keys in held):
                    break
                n += 1
        if n == len(blocks):
            return n
        return max(n, self.predicted.match(engine, blocks, now))

    def record(self, engine: Engine, blocks: Sequence[int], now: float,
               block_size: int | None = None) -> None:
        """A request with ``blocks`` was routed to ``engine`` at ``now``."""
        self.approximate.record(engine, blocks, now, block_size)
        self.predicted.record(engine, blocks, now, block_size)

    def forget(self, engine_id: str) -> None:
        self.approximate.forget(engine_id)
        self.predicted.forget(engine_id)
        c = self._engines.pop(engine_id, None)
        if c is not None:
            self._reset(c)

    # ---------------------------------------------------------------- events

    def apply(self, engine: Engine, events: Sequence[Event]) -> None:
        c = self._cache(engine, create=True)
        assert c is not None
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self._reset(c)
                continue
            if ev.group_idx in c.partial:
                continue
            g = c.groups.get(ev.group_idx)
            if g is None:
                g = c.groups[ev.group_idx] = _Group()
            if isinstance(ev, BlockStored):
                if len(ev.block_hashes) * ev.block_size != len(ev.token_ids):
                    c.partial.add(ev.group_idx)  # a sliding-window group: not a prefix
                    self._total -= len(g.blocks)
                    del c.groups[ev.group_idx]
                    continue
                if not self._stored(g, ev):
                    c.lossy = True
            elif isinstance(ev, BlockRemoved):
                self._removed(g, ev.block_hashes)
        self._trim()

    def clear(self, engine: Engine) -> None:
        c = self._cache(engine, create=True)
        assert c is not None
        self._reset(c)

    def set_synced(self, engine: Engine, synced: bool) -> None:
        c = self._cache(engine, create=True)
        assert c is not None
        c.synced = synced

    # ---------------------------------------------------------------- internals

    def _cache(self, engine: Engine, create: bool = False) -> _EngineCache | None:
        c = self._engines.get(engine.id)
        if c is not None and c.generation != engine.generation:
            # a new process: its cache starts empty; sync state is the subscriber's
            self._reset(c)
            c.generation = engine.generation
        if c is None and create:
            c = self._engines[engine.id] = _EngineCache(engine.generation)
        return c

    def _reset(self, c: _EngineCache) -> None:
        self._total -= sum(len(g.blocks) for g in c.groups.values())
        c.groups.clear()
        c.lossy = False

    def _stored(self, c: _Group, ev: BlockStored) -> bool:
        """Add ``ev``'s blocks to group ``c``; False when its parent is unknown (the
        blocks are skipped: their place in the chain cannot be computed)."""
        if ev.parent_block_hash is None:
            tail, pending, salt = None, _EMPTY, event_salt(ev)
        else:
            parent = c.blocks.get(ev.parent_block_hash)
            if parent is None:
                self.unanchored += 1
                return False
            tail, pending, salt = parent.tail, parent.pending, parent.salt
        size, gsize = ev.block_size, self.block_size or ev.block_size
        tokens = ev.token_ids
        for i, h in enumerate(ev.block_hashes):
            chunk = tokens[i * size:(i + 1) * size]
            stream = list(pending) + chunk if pending else chunk
            n_full = len(stream) // gsize * gsize
            keys = chain_block_hashes(stream[:n_full], gsize, salt, parent=tail) if n_full else []
            if keys:
                tail, salt = keys[-1], None
            pending = tuple(stream[n_full:]) if n_full < len(stream) else _EMPTY
            b = c.blocks.get(h)
            if b is not None:
                b.count += 1
                continue
            c.blocks[h] = _Block(tuple(keys), tail, pending, salt)
            self._total += 1
            for k in keys:
                c.keys[k] = c.keys.get(k, 0) + 1
        return True

    def _removed(self, c: _Group, hashes: Sequence[ExternalBlockHash]) -> None:
        for h in hashes:
            b = c.blocks.get(h)
            if b is None:
                continue
            b.count -= 1
            if b.count <= 0:
                self._drop(c, h)

    def _drop(self, c: _Group, h: ExternalBlockHash) -> None:
        b = c.blocks.pop(h)
        self._total -= 1
        for k in b.keys:
            left = c.keys[k] - 1
            if left:
                c.keys[k] = left
            else:
                del c.keys[k]

    def _trim(self) -> None:
        while self._total > self.max_entries:
            cache, largest = max(((c, g) for c in self._engines.values()
                                  for g in c.groups.values()), key=lambda x: len(x[1].blocks))
            cache.lossy = True
            for _ in range(min(self._total - self.max_entries, len(largest.blocks))):
                self._drop(largest, next(iter(largest.blocks)))
