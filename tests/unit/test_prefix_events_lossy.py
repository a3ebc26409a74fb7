"""The precise prefix index once it has dropped blocks an engine still holds (issue
44: past its memory cap on a long loaded replay, its recall fell to 0.62): the
approximate index completes its matches until the engine's cache is empty again."""

from __future__ import annotations

from engines.blocks import chain_block_hashes
from engines.kv_events import AllBlocksCleared
from engines.pool import Engine
from engines.prefix_events import EVENT_ENTRY_BYTES, EventPrefixIndex
from tests.unit.test_prefix_events import stored, synced_index


def conversation(idx: EventPrefixIndex, e: Engine, turns: int, now: float) -> list[int]:
    """A conversation of ``turns`` turns of 4 engine blocks (4 tokens each), each turn
    routed to ``e`` (recorded) and then stored by it as the child of the last; returns
    the gateway keys of the whole conversation."""
    tokens = list(range(1000, 1000 + 16 * turns))
    for t in range(turns):
        hashes = [f"c{4 * t + i}" for i in range(4)]
        idx.record(e, chain_block_hashes(tokens[:16 * (t + 1)], 4), now)
        idx.apply(e, [stored(hashes, tokens[16 * t:16 * (t + 1)], 4,
                             parent=f"c{4 * t - 1}" if t else None)])
    return chain_block_hashes(tokens, 4)


def test_blocks_trimmed_by_the_cap_are_completed_by_the_approximate_index() -> None:
    e = Engine("e", "m", "http://x")
    idx = synced_index(e, max_bytes=64 * 2 * EVENT_ENTRY_BYTES)  # 64 precise entries
    assert idx.max_entries == 64
    keys = conversation(idx, e, 10, now=0.0)  # 40 blocks: fits
    assert idx.match(e, keys, 1.0) == 40 and not idx.lossy(e)
    # other prompts fill the cap: the conversation's first turns are trimmed
    for n in range(12):
        toks = list(range(5000 + 16 * n, 5000 + 16 * (n + 1)))
        idx.apply(e, [stored([f"o{4 * n + i}" for i in range(4)], toks, 4)])
    assert len(idx) == 64 and idx.lossy(e)
    # the engine still holds the whole conversation (its cache is far larger): the
    # routing history says so where the events index no longer can
    assert idx.match(e, keys, 2.0) == 40
    # a new turn of it, stored on a parent the index trimmed, is unanchored but
    # still matched
    more = conversation(idx, e, 11, now=3.0)
    assert idx.match(e, more, 4.0) == 44


def test_an_unanchored_store_makes_the_engine_lossy_until_its_cache_is_cleared() -> None:
    e = Engine("e", "m", "http://x")
    idx = synced_index(e)
    idx.apply(e, [stored(["x1"], [1, 2, 3, 4], 4, parent="unknown")])
    assert idx.unanchored == 1 and idx.lossy(e)
    idx.apply(e, [AllBlocksCleared()])
    assert not idx.lossy(e)
    # an index that dropped nothing answers from the events alone: a prompt routed
    # there whose blocks the engine evicted is not predicted cached
    keys = chain_block_hashes(list(range(16)), 4)
    idx.record(e, keys, now=0.0)
    assert idx.match(e, keys, now=100.0) == 0
