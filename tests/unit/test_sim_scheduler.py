"""Simulator core: block accounting, prefix hits in tokens, LRU eviction of free
blocks only, preemption under block shortage, queueing at max_num_seqs, salts."""

from __future__ import annotations

import itertools

import pytest

from engines.blocks import chain_block_hashes
from loadtest.sim_engine.kv_cache import KVCache
from loadtest.sim_engine.profiles import CPU_GEMMA3_270M_QUIET, H200_LLAMA31_8B, Profile
from loadtest.sim_engine.scheduler import Scheduler, SimRequest, Status

BS = 4
_ids = itertools.count()


def profile(**kw) -> Profile:
    base = dict(name="t", block_size=BS, num_blocks=33, max_num_seqs=8,
                max_num_batched_tokens=64, max_model_len=64, step_fixed_s=0.01,
                prefill_token_s=0.001, decode_seq_s=0.002)
    base.update(kw)
    return Profile(**base)


def make(p: Profile) -> Scheduler:
    return Scheduler(p, KVCache(p.num_blocks, p.block_size))


def req(tokens: list[int], max_tokens: int = 2, salt: str | None = None) -> SimRequest:
    return SimRequest(f"r{next(_ids)}", len(tokens), chain_block_hashes(tokens, BS, salt),
                      max_tokens)


def run_until_done(s: Scheduler, *reqs: SimRequest, limit: int = 1000) -> int:
    steps = 0
    while not all(r.done for r in reqs):
        s.commit(s.schedule(), float(steps))
        steps += 1
        assert steps < limit
    return steps


def serve(s: Scheduler, *reqs: SimRequest) -> None:
    """Add ``reqs`` and step until they are done."""
    for r in reqs:
        s.add(r)
    run_until_done(s, *reqs)


def test_block_accounting_and_usage():
    s = make(profile())
    r = req(list(range(10)), max_tokens=3)  # 10 prompt tokens → 3 blocks
    s.add(r)
    plan = s.schedule()
    assert plan.scheduled == [(r, 10)] and plan.prefill_tokens == 10
    assert len(r.blocks) == 3 and s.kv.num_free_blocks == 32 - 3
    assert s.kv.usage == pytest.approx(3 / 32)
    s.commit(plan, 0.0)
    assert r.num_output_tokens == 1 and r.first_token_s == 0.0
    # Decode: token 11 fits block 3; token 13 needs a 4th block.
    plan = s.schedule()
    assert plan.decode_seqs == 1 and plan.kv_tokens == 10 and plan.prefill_tokens == 0
    s.commit(plan, 1.0)
    s.commit(s.schedule(), 2.0)
    assert r.status is Status.FINISHED and r.num_output_tokens == 3
    assert s.kv.num_free_blocks == 32 and s.kv.usage == 0.0
    assert s.counters.generation_tokens == 3 and s.counters.prompt_tokens == 10


def test_prefix_hits_in_tokens_full_blocks_only():
    s = make(profile())
    shared = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = req(shared + [1, 2, 3])
    serve(s, a)
    b = req(shared + [7, 8, 9])
    s.add(b)
    s.commit(s.schedule(), 0.0)
    # 13 tokens: blocks 0,1 shared (8 tokens); block 2 differs.
    assert b.num_cached_tokens == 8
    assert s.counters.prefix_cache_queries == 26 and s.counters.prefix_cache_hits == 8
    # A fully cached prompt still recomputes its last block (num_tokens − 1 cap).
    c_tokens = list(range(300, 312))  # exactly 3 blocks
    serve(s, req(c_tokens))
    c2 = req(c_tokens)
    s.add(c2)
    plan = s.schedule()
    assert c2.num_cached_tokens == 8 and plan.prefill_tokens == 4


def test_short_prompt_never_hits():
    s = make(profile())
    serve(s, req([1, 2, 3]))
    r = req([1, 2, 3])
    serve(s, r)
    assert r.num_cached_tokens == 0 and s.counters.prefix_cache_hits == 0


def test_lru_evicts_only_free_blocks_oldest_first():
    p = profile(num_blocks=9, max_model_len=32)  # 8 usable blocks
    s = make(p)
    old = list(range(1000, 1008))    # 2 blocks
    newer = list(range(2000, 2008))  # 2 blocks
    serve(s, req(old, 1))
    serve(s, req(newer, 1))
    assert s.kv.num_cached_blocks == 4
    held = req(list(range(3000, 3012)), max_tokens=50)  # 3 blocks, then a 4th
    s.add(held)
    s.commit(s.schedule(), 0.0)
    held_blocks = list(held.blocks)
    # Free queue now: [never used, old tail, old head, newer tail, newer head].
    # held's decode takes the never-used block; fill's 2 blocks evict "old".
    fill = req(list(range(4000, 4008)), 1)
    s.add(fill)
    s.commit(s.schedule(), 1.0)
    assert all(b.ref_cnt >= 1 for b in held_blocks)  # running blocks never evicted
    probe_new = req(newer + [5], 1)
    s.add(probe_new)
    s.commit(s.schedule(), 2.0)
    assert probe_new.num_cached_tokens == 8  # the more recent prefix survived
    probe_old = req(old + [5], 1)
    s.add(probe_old)
    s.commit(s.schedule(), 3.0)
    assert probe_old.num_cached_tokens < 8  # the oldest prefix was evicted
    assert s.kv.evictions >= 1


def test_tail_block_evicted_before_head():
    p = profile(num_blocks=5, max_model_len=16)  # 4 usable blocks
    s = make(p)
    prompt = list(range(500, 512))  # 3 blocks, all cached after the run
    serve(s, req(prompt, 1))
    other = req([9] * 6, 1)  # needs 2 blocks: 1 uncached free, then evict 1 cached
    serve(s, other)
    again = req(prompt + [1], 1)
    s.add(again)
    s.schedule()
    assert again.num_cached_tokens == 8  # head blocks kept, the tail block went


def test_waiting_queue_at_max_num_seqs():
    s = make(profile(max_num_seqs=2))
    reqs = [req(list(range(i * 10, i * 10 + 5)), 3) for i in range(4)]
    for r in reqs:
        s.add(r)
    s.schedule()
    assert len(s.running) == 2 and len(s.waiting) == 2
    assert [r.status for r in reqs] == [Status.RUNNING] * 2 + [Status.WAITING] * 2
    run_until_done(s, *reqs)
    # FCFS: the waiting ones start only after the first ones finish.
    assert reqs[2].first_token_s > reqs[0].last_token_s - 1e-9


def test_chunked_prefill_respects_token_budget():
    s = make(profile(max_num_batched_tokens=8, max_model_len=64, num_blocks=40))
    r = req(list(range(20)), 1)
    s.add(r)
    sizes = []
    while not r.done:
        plan = s.schedule()
        sizes.append(plan.prefill_tokens)
        s.commit(plan, 0.0)
    assert sizes == [8, 8, 4]


def test_preemption_by_recompute_under_block_shortage():
    p = profile(num_blocks=7, max_model_len=24, max_num_batched_tokens=64)  # 6 usable
    s = make(p)
    first = req(list(range(100, 108)), max_tokens=12)   # 2 blocks, grows to 5
    second = req(list(range(200, 208)), max_tokens=12)  # 2 blocks, grows to 5
    s.add(first)
    s.add(second)
    run_until_done(s, first, second)
    assert s.counters.num_preemptions >= 1
    assert second.num_preemptions >= 1 and first.num_preemptions == 0  # newest goes
    assert first.last_token_s < second.last_token_s
    assert s.kv.num_free_blocks == 6
    # Resumed requests are not counted again as prefix-cache queries.
    assert s.counters.prefix_cache_queries == 16


def test_abort_frees_blocks_and_running_slot():
    s = make(profile())
    r = req(list(range(12)), 100)
    w = req(list(range(50, 60)), 1)
    s.add(r)
    s.commit(s.schedule(), 0.0)
    s.add(w)
    s.abort(r)
    s.abort(r)  # idempotent
    assert r.status is Status.ABORTED and not s.running and s.kv.num_free_blocks == 32
    s.abort(w)
    assert not s.waiting


def test_salt_isolation():
    s = make(profile())
    prompt = list(range(700, 713))
    serve(s, req(prompt, 1, salt="tenant-a"))
    other = req(prompt, 1, salt="tenant-b")
    serve(s, other)
    same = req(prompt, 1, salt="tenant-a")
    serve(s, same)
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 12


def test_profiles_are_sane():
    for p in (CPU_GEMMA3_270M_QUIET, H200_LLAMA31_8B):
        assert (p.num_blocks - 1) * p.block_size >= p.max_model_len
    # CPU fit reproduces docs/engines.md: ~20 tok/s single stream, ~110 at 8, ~145 at 16.
    cpu = CPU_GEMMA3_270M_QUIET
    for b, tok_s in ((1, 20), (8, 110), (16, 145)):
        assert b / cpu.step_seconds(0, b, 0) == pytest.approx(tok_s, rel=0.07)
    assert cpu.step_seconds(372, 0, 0) == pytest.approx(0.5, rel=0.05)
    assert cpu.step_seconds(372 - 256, 0, 0) == pytest.approx(0.195, rel=0.08)
