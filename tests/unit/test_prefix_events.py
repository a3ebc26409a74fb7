"""The precise prefix index: engine blocks → the gateway's own keys (equal and
different block sizes, salts), removals, duplicates, clears, restarts, the
predicted-on-route side index, the approximate fallback, the memory cap; and the
simulator's KV cache as an event source that the index follows exactly."""

from __future__ import annotations

import random
import tracemalloc

from engines.blocks import chain_block_hashes
from engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from engines.pool import Engine
from engines.prefix_events import EVENT_ENTRY_BYTES, EventPrefixIndex, event_salt
from loadtest.sim_engine.kv_cache import KVCache
from loadtest.sim_engine.profiles import Profile
from loadtest.sim_engine.scheduler import Scheduler, SimRequest


def stored(hashes, tokens, bs, parent=None, salt=None):
    extra = [(salt,) if salt and parent is None and i == 0 else None for i in range(len(hashes))]
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent,
                       token_ids=list(tokens), block_size=bs, lora_id=None, medium="GPU",
                       lora_name=None, extra_keys=extra)


def synced_index(engine: Engine, **kw) -> EventPrefixIndex:
    idx = EventPrefixIndex(**kw)
    idx.set_synced(engine, True)
    return idx


def test_engine_blocks_map_to_gateway_keys_with_salt_and_parent():
    e = Engine("e", "m", "http://x")
    idx = synced_index(e)
    tokens = list(range(100, 140))  # 10 blocks of 4
    mine = chain_block_hashes(tokens, 4, "tenant-a")
    # engine hashes are its own (here: strings' hashes), unrelated to ours
    idx.apply(e, [stored([f"e{i}" for i in range(6)], tokens[:24], 4, salt="tenant-a")])
    idx.apply(e, [stored(["e6", "e7"], tokens[24:32], 4, parent="e5")])
    assert idx.match(e, mine, now=0.0) == 8
    assert idx.match(e, chain_block_hashes(tokens, 4, "tenant-b"), now=0.0) == 0
    assert idx.match(e, chain_block_hashes(tokens, 4), now=0.0) == 0
    # a child of an unknown parent cannot be placed in the chain: skipped
    idx.apply(e, [stored(["x9"], tokens[32:36], 4, parent="nope")])
    assert idx.unanchored == 1 and idx.entries("e") == 8


def test_gateway_block_size_differs_from_engine():
    e = Engine("e", "m", "http://x")
    idx = synced_index(e, block_size=6)  # gateway hashes 6-token blocks, engine 4
    tokens = list(range(7, 31))  # 24 tokens: engine 6 blocks, gateway 4 blocks
    mine = chain_block_hashes(tokens, 6, "s")
    idx.apply(e, [stored(["a0", "a1", "a2"], tokens[:12], 4, salt="s")])
    assert idx.match(e, mine, 0.0) == 2  # tokens 0..11 held: gateway blocks 0 and 1
    idx.apply(e, [stored(["a3"], tokens[12:16], 4, parent="a2")])
    assert idx.match(e, mine, 0.0) == 2  # 16 tokens: block 2 (12..17) not complete
    idx.apply(e, [stored(["a4", "a5"], tokens[16:24], 4, parent="a3")])
    assert idx.match(e, mine, 0.0) == 4
    # evicting engine block a4 (tokens 16..19) loses gateway block 2 (12..17), so the
    # run from the start stops at 2 even though block 3 (ends in a5) is still held
    idx.apply(e, [BlockRemoved(["a4"], "GPU")])
    assert idx.match(e, mine, 0.0) == 2


def test_removed_duplicates_cleared_and_generation():
    e = Engine("e", "m", "http://x")
    idx = synced_index(e)
    tokens = list(range(8))
    mine = chain_block_hashes(tokens, 4)
    idx.apply(e, [stored(["h0", "h1"], tokens, 4)])
    idx.apply(e, [stored(["h0"], tokens[:4], 4)])  # the same hash in a second block
    idx.apply(e, [BlockRemoved(["h0"], "GPU")])
    assert idx.match(e, mine, 0.0) == 2  # one copy left
    idx.apply(e, [BlockRemoved(["h0"], "GPU")])
    assert idx.match(e, mine, 0.0) == 0 and idx.entries("e") == 1
    idx.apply(e, [AllBlocksCleared()])
    assert len(idx) == 0
    idx.apply(e, [stored(["h0", "h1"], tokens, 4)])
    e.generation += 1  # restarted: a new process with an empty cache
    assert idx.match(e, mine, 0.0) == 0 and len(idx) == 0


def test_predicted_side_index_and_approximate_fallback():
    e, f = Engine("e", "m", "http://x"), Engine("f", "m", "http://y")
    idx = EventPrefixIndex(predicted_ttl_s=5.0, ttl_s=600.0)
    blocks = chain_block_hashes(list(range(16)), 4)
    idx.set_synced(e, True)
    idx.record(e, blocks, now=100.0)  # routed, not yet stored by the engine
    assert idx.match(e, blocks, now=101.0) == 4  # siblings still land together
    assert idx.match(e, blocks, now=106.0) == 0  # prediction expired, no event came
    # f has no synced events: the approximate index (routing history, long TTL) answers
    idx.record(f, blocks, now=100.0)
    assert idx.match(f, blocks, now=300.0) == 4
    idx.set_synced(f, True)
    assert idx.match(f, blocks, now=300.0) == 0


def test_memory_cap_and_entry_size():
    e = Engine("e", "m", "http://x")
    cap_bytes = 4 << 20
    idx = synced_index(e, max_bytes=cap_bytes)
    rng = random.Random(1)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    n = 0
    for _ in range(4000):  # 4000 prompts of 4 blocks = 16000 engine blocks > cap
        tokens = [rng.randrange(1 << 18) for _ in range(16)]
        idx.apply(e, [stored([n, n + 1, n + 2, n + 3], tokens, 4)])
        n += 4
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(idx) == idx.max_entries == cap_bytes // 2 // EVENT_ENTRY_BYTES
    assert used / len(idx) <= EVENT_ENTRY_BYTES, used / len(idx)
    assert used <= cap_bytes // 2
    # the oldest stored went first: the newest prompt is still matched
    assert idx.match(e, chain_block_hashes(tokens, 4), 0.0) == 4


def test_sliding_window_groups_are_left_out():
    """vLLM 0.32 on Gemma 3 (seen on the CPU build): per step one BlockStored per
    KV-cache group with the same hashes; the sliding-window groups list only the
    blocks inside their window (4 of 9 here) over all 9 blocks' tokens, and remove
    blocks the full-attention group keeps."""
    e = Engine("e", "m", "http://x")
    idx = synced_index(e)
    tokens = list(range(36))
    mine = chain_block_hashes(tokens, 4)
    window = stored([5, 6, 7, 8], tokens, 4)
    window.group_idx = 1
    full = stored(list(range(9)), tokens, 4)
    full.group_idx = 0
    idx.apply(e, [window, full])
    assert idx.match(e, mine, 0.0) == 9 and idx.entries("e") == 9
    slid = BlockRemoved([5], "GPU", group_idx=1)  # left the window, still cached in group 0
    idx.apply(e, [slid])
    assert idx.match(e, mine, 0.0) == 9
    idx.apply(e, [BlockRemoved([5], "GPU", group_idx=0)])
    assert idx.match(e, mine, 0.0) == 5


def test_event_salt_skips_lora_name():
    ev = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2,
                     lora_id=3, medium=None, lora_name="adapter", extra_keys=[("adapter", "salt")])
    assert event_salt(ev) == "salt"


def test_index_follows_simulator_cache_exactly():
    """The simulator's KV cache publishes every store and eviction; fed those events,
    the index holds exactly the hashes the cache holds (the simulator hashes with the
    gateway's own chain, so its hashes are the gateway's keys)."""
    p = Profile(name="t", block_size=4, num_blocks=40, max_num_seqs=4, max_num_batched_tokens=32,
                max_model_len=64, step_fixed_s=0.01, prefill_token_s=0.001, decode_seq_s=0.002)
    kv = KVCache(p.num_blocks, p.block_size, events=True)
    sched = Scheduler(p, kv)
    e = Engine("e", "m", "http://x")
    idx = synced_index(e)
    rng = random.Random(7)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(8, 24))] for _ in range(6)]
    reqs = []
    for i in range(60):
        tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
        salt = rng.choice([None, "a"])
        r = SimRequest(f"r{i}", len(tokens), chain_block_hashes(tokens, 4, salt), 3,
                       token_ids=tokens, cache_salt=salt)
        sched.add(r)
        reqs.append(r)
        for step in range(rng.randrange(0, 4)):
            sched.commit(sched.schedule(), float(step))
            idx.apply(e, kv.take_events())
    while not all(r.done for r in reqs):
        sched.commit(sched.schedule(), 0.0)
        idx.apply(e, kv.take_events())
    assert kv.evictions > 0
    held = set(idx._engines["e"].groups[None].keys)
    assert held == set(kv._cached)
    for r in reqs[-10:]:
        want = len(kv.longest_prefix(r.block_hashes, 10**9))
        assert idx.match(e, r.block_hashes, 0.0) == want
