"""PrefixIndex: longest held prefix, LRU order, expiry, restarts, capacity and the
memory cap; SessionTable."""

from __future__ import annotations

import gc
import random
import tracemalloc

from engines.pool import Engine, MetricsSnapshot
from engines.prefix import ENTRY_BYTES, PrefixIndex
from engines.sessions import SessionTable


def eng(id_: str = "a", num_blocks: int | None = None, block_size: int = 16) -> Engine:
    e = Engine(id=id_, model="m", base_url=f"http://{id_}")
    if num_blocks:
        e.metrics = MetricsSnapshot(at=0.0, num_blocks=num_blocks, block_size=block_size)
    return e


def prompt(*ids: int) -> tuple[int, ...]:
    """Chained-style hashes: block i's value encodes the whole prefix."""
    out, acc = [], 0
    for i in ids:
        acc = hash((acc, i)) & (2**64 - 1)
        out.append(acc)
    return tuple(out)


def test_match_counts_leading_blocks_per_engine() -> None:
    idx, a, b = PrefixIndex(), eng("a"), eng("b")
    p = prompt(1, 2, 3, 4)
    assert idx.match(a, p, 0) == 0
    idx.record(a, p[:3], 0)
    assert idx.match(a, p, 1) == 3
    assert idx.match(a, prompt(1, 2, 9, 9), 1) == 2
    assert idx.match(a, prompt(7), 1) == 0
    assert idx.match(b, p, 1) == 0
    assert idx.match(a, (), 1) == 0
    assert len(idx) == 3


def test_entries_expire() -> None:
    idx, a = PrefixIndex(ttl_s=10), eng()
    p = prompt(1, 2, 3)
    idx.record(a, p, 0)
    assert idx.match(a, p, 9.9) == 3
    assert idx.match(a, p, 10.1) == 0
    idx.record(a, prompt(5), 20)  # insert drops expired entries
    assert idx.entries("a") == 1


def test_shared_head_touched_again_outlives_tails() -> None:
    idx, a = PrefixIndex(ttl_s=10), eng()
    first, second = prompt(1, 2, 3), prompt(1, 2, 4)
    idx.record(a, first, 0)
    idx.record(a, second, 8)
    assert idx.match(a, first, 15) == 2  # shared head refreshed, first's tail expired
    assert idx.match(a, second, 15) == 3


def test_restart_drops_the_engine_entries() -> None:
    idx, a = PrefixIndex(), eng()
    p = prompt(1, 2)
    idx.record(a, p, 0)
    a.generation += 1
    assert idx.match(a, p, 1) == 0
    assert len(idx) == 0
    idx.record(a, p, 2)
    assert idx.match(a, p, 3) == 2


def test_engine_capacity_bounds_entries_and_evicts_tails_first() -> None:
    idx = PrefixIndex()
    a = eng("a", num_blocks=8, block_size=16)  # holds 8 blocks of 16 tokens
    old = prompt(1, 2, 3, 4, 5)
    idx.record(a, old, 0, block_size=16)
    idx.record(a, prompt(9, 8, 7, 6), 1, block_size=16)
    assert idx.entries("a") == 8
    assert idx.match(a, old, 2) == 4  # lost its last block only
    big = eng("b", num_blocks=8, block_size=32)  # 256 tokens = 16 blocks of 16
    idx.record(big, prompt(*range(20)), 0, block_size=16)
    assert idx.entries("b") == 16


def test_global_cap_evicts_from_the_largest_engine() -> None:
    idx = PrefixIndex(max_bytes=10 * ENTRY_BYTES)
    a, b = eng("a"), eng("b")
    idx.record(a, prompt(*range(8)), 0)
    idx.record(b, prompt(*range(100, 104)), 1)
    assert len(idx) == 10 and idx.entries("a") == 6 and idx.entries("b") == 4
    assert idx.match(a, prompt(*range(8)), 2) == 6


def test_memory_stays_under_cap_over_100k_unique_prompts() -> None:
    """100,000 unique prompts of 2–14 blocks over 4 engines under a 4 MiB cap:
    entries stay at the cap and the measured memory under it."""
    cap = 4 << 20
    rng = random.Random(0)
    engines = [eng(f"e{i}") for i in range(4)]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    idx = PrefixIndex(max_bytes=cap, ttl_s=1e9)
    peak_entries = 0
    for n in range(100_000):
        blocks = tuple(rng.getrandbits(64) for _ in range(rng.randint(2, 14)))
        idx.record(engines[n % 4], blocks, float(n))
        peak_entries = max(peak_entries, len(idx))
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert peak_entries <= idx.max_entries == cap // ENTRY_BYTES
    per_entry = used / len(idx)
    print(f"\nprefix index: {len(idx)} entries, {used / 2**20:.1f} MiB, "
          f"{per_entry:.0f} B/entry (budget {ENTRY_BYTES})")
    assert used <= cap
    assert per_entry <= ENTRY_BYTES


def test_sessions_stick_expire_and_forget_restarted_engines() -> None:
    t = SessionTable(max_sessions=2, ttl_s=10)
    a, b = eng("a"), eng("b")
    assert t.engine_for("s1", [a, b], 0) is None
    t.record("s1", a, 0)
    assert t.engine_for("s1", [a, b], 1) == "a"
    assert t.engine_for("s1", [b], 1) is None  # not a candidate now
    assert t.engine_for("s1", [a, b], 11) is None  # expired
    t.record("s1", a, 20)
    a.generation += 1
    assert t.engine_for("s1", [a, b], 21) is None
    t.record("s2", b, 22)
    t.record("s3", b, 23)
    t.record(None, b, 23)
    assert len(t) == 2 and t.engine_for("s1", [a, b], 24) is None
