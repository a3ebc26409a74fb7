"""Every JobStore behaviour, on the embedded SQLite store and on the machine's
PostgreSQL (127.0.0.1:5432, trust auth, database ``test``; each test in a schema of
its own), on a hand-driven wall clock."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from batch.jsonl import InvalidFile, Line, parse
from batch.store import JobStore, open_job_store
from tests.support import ManualClock

PG = "postgresql://postgres@127.0.0.1:5432/test"
LEASE_S = 30.0


@pytest.fixture(params=["sqlite", "postgresql"])
async def clock_store(request: pytest.FixtureRequest,
                      tmp_path: Path) -> AsyncIterator[tuple[JobStore, ManualClock]]:
    clock = ManualClock(t=1_800_000_000.0)
    if request.param == "sqlite":
        store = await open_job_store("sqlite://", tmp_path, now=clock.now)
        yield store, clock
        await store.close()
        return
    schema = f"t_{secrets.token_hex(6)}"
    conn = await asyncpg.connect(PG)
    await conn.execute(f"CREATE SCHEMA {schema}")
    store = await open_job_store(f"{PG}?search_path={schema}", now=clock.now)
    try:
        yield store, clock
    finally:
        await store.close()
        await conn.execute(f"DROP SCHEMA {schema} CASCADE")
        await conn.close()


@pytest.fixture
def store(clock_store: tuple[JobStore, ManualClock]) -> JobStore:
    return clock_store[0]


@pytest.fixture
def clock(clock_store: tuple[JobStore, ManualClock]) -> ManualClock:
    return clock_store[1]


def lines(n: int, url: str = "/v1/chat/completions") -> list[Line]:
    return [Line(f"req-{i}", url, {"model": "m", "messages": [], "max_tokens": i})
            for i in range(n)]


async def new_batch(store: JobStore, n: int, tenant: str = "t", window_s: float = 86400):
    f = await store.add_file(tenant, "batch", "in.jsonl", b"{}", n)
    return await store.create_batch(tenant, "/v1/chat/completions", f.id, "24h", window_s,
                                    None, lines(n))


async def output(store: JobStore, tenant: str, batch_id: str) -> tuple[list[dict], list[dict]]:
    b = await store.get_batch(tenant, batch_id)
    files = []
    for fid in (b.output_file_id, b.error_file_id):
        data = await store.file_content(fid) if fid else b""
        files.append([json.loads(x) for x in data.decode().splitlines()])
    return files[0], files[1]


async def test_files_are_stored_listed_and_deleted_per_tenant(store: JobStore,
                                                              clock: ManualClock) -> None:
    a1 = await store.add_file("a", "batch", "one.jsonl", b"first", 1)
    clock.advance(1)
    a2 = await store.add_file("a", "batch", "two.jsonl", b"second", 1)
    b1 = await store.add_file("b", "batch", "mine.jsonl", b"b's", 1)
    assert (await store.get_file("a", a1.id)).bytes == 5
    assert await store.file_content(a2.id) == b"second"
    assert await store.get_file("b", a1.id) is None  # another tenant's file is absent
    assert [f.id for f in await store.list_files("a", 10)] == [a2.id, a1.id]
    assert [f.id for f in await store.list_files("a", 10, after=a2.id)] == [a1.id]
    assert not await store.delete_file("b", a1.id)
    assert await store.delete_file("a", a1.id)
    assert await store.get_file("a", a1.id) is None and await store.file_content(a1.id) is None
    assert [f.id for f in await store.list_files("b", 10)] == [b1.id]


async def test_a_batch_runs_each_line_once_and_writes_both_files(store: JobStore) -> None:
    batch = await new_batch(store, 3)
    claimed = await store.claim("w1", 10, LEASE_S)
    assert [c.custom_id for c in claimed] == ["req-0", "req-1", "req-2"]
    assert await store.claim("w2", 10, LEASE_S) == []  # all leased
    assert await store.finish("w1", claimed[0], 200, {"ok": 0}, "r0")
    assert await store.finish("w1", claimed[2], 400, {"error": {"code": "bad"}}, "r2")
    assert await store.finalize_due() == []  # one line still running
    assert await store.finish("w1", claimed[1], 200, {"ok": 1}, "r1")
    assert await store.finalize_due() == [batch.id]
    assert await store.finalize_due() == []  # once
    got = await store.get_batch("t", batch.id)
    assert got.status == "completed"
    assert got.to_openai()["request_counts"] == {"total": 3, "completed": 2, "failed": 1,
                                                 "expired": 0, "cancelled": 0}
    out, err = await output(store, "t", batch.id)
    assert [(x["custom_id"], x["response"]["status_code"], x["response"]["body"])
            for x in out] == [("req-0", 200, {"ok": 0}), ("req-1", 200, {"ok": 1})]
    assert [(x["custom_id"], x["response"]["status_code"]) for x in err] == [("req-2", 400)]


async def test_an_expired_lease_is_claimed_again_and_the_late_result_dropped(
        store: JobStore, clock: ManualClock) -> None:
    batch = await new_batch(store, 2)
    first = await store.claim("dead", 10, LEASE_S)
    clock.advance(LEASE_S / 2)
    assert await store.renew("dead", LEASE_S, [(batch.id, 0)]) == 1  # only line 0 kept
    clock.advance(LEASE_S / 2 + 1)
    again = await store.claim("alive", 10, LEASE_S)
    assert [c.idx for c in again] == [1]  # line 1's lease lapsed; line 0's was renewed
    assert await store.finish("alive", again[0], 200, {"by": "alive"}, "r")
    assert not await store.finish("dead", first[1], 200, {"by": "dead"}, "r")  # dropped
    assert await store.finish("dead", first[0], 200, {"by": "dead"}, "r")
    await store.finalize_due()
    out, err = await output(store, "t", batch.id)
    assert [(x["custom_id"], x["response"]["body"]["by"]) for x in out] == [
        ("req-0", "dead"), ("req-1", "alive")]
    assert err == []


async def test_concurrent_claims_never_share_a_line(store: JobStore) -> None:
    await new_batch(store, 40)
    got = await asyncio.gather(*(store.claim(f"w{i}", 7, LEASE_S) for i in range(8)))
    keys = [(c.batch_id, c.idx) for batch in got for c in batch]
    assert len(keys) == len(set(keys)) == 40


async def test_retry_later_waits_and_counts_attempts_only_when_told(
        store: JobStore, clock: ManualClock) -> None:
    await new_batch(store, 1)
    (line,) = await store.claim("w", 1, LEASE_S)
    assert await store.retry_later("w", line, 5.0, attempt=False)
    assert await store.claim("w", 1, LEASE_S) == []  # not due yet
    clock.advance(5)
    (line,) = await store.claim("w", 1, LEASE_S)
    assert line.attempts == 0
    await store.retry_later("w", line, 0.0, attempt=True)
    (line,) = await store.claim("w", 1, LEASE_S)
    assert line.attempts == 1


async def test_release_hands_back_every_line_at_once(store: JobStore) -> None:
    await new_batch(store, 3)
    await store.claim("w", 10, LEASE_S)
    assert await store.release("w") == 3
    assert len(await store.claim("v", 10, LEASE_S)) == 3


async def test_cancel_stops_unstarted_lines_and_lets_running_ones_finish(
        store: JobStore) -> None:
    batch = await new_batch(store, 4)
    running = await store.claim("w", 1, LEASE_S)
    assert (await store.cancel_batch("other", batch.id)) is None  # not theirs
    cancelling = await store.cancel_batch("t", batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelled == 3
    assert await store.claim("w", 10, LEASE_S) == []  # the rest never start
    assert await store.finalize_due() == []  # one still running
    assert await store.finish("w", running[0], 200, {}, "r")
    assert await store.finalize_due() == [batch.id]
    done = await store.get_batch("t", batch.id)
    assert done.status == "cancelled" and done.times["cancelled_at"] is not None
    out, err = await output(store, "t", batch.id)
    assert [x["custom_id"] for x in out] == ["req-0"]
    assert [(x["custom_id"], x["error"]["code"]) for x in err] == [
        ("req-1", "batch_cancelled"), ("req-2", "batch_cancelled"), ("req-3", "batch_cancelled")]
    assert (await store.cancel_batch("t", batch.id)).status == "cancelled"  # unchanged


async def test_a_batch_past_its_window_expires_its_unfinished_lines(
        store: JobStore, clock: ManualClock) -> None:
    batch = await new_batch(store, 3, window_s=60)
    claimed = await store.claim("w", 2, LEASE_S)
    await store.finish("w", claimed[0], 200, {}, "r")
    clock.advance(61)
    assert await store.finalize_due() == [batch.id]
    assert not await store.finish("w", claimed[1], 200, {}, "r")  # too late: dropped
    got = await store.get_batch("t", batch.id)
    assert got.status == "expired"
    assert got.to_openai()["request_counts"] == {"total": 3, "completed": 1, "failed": 2,
                                                 "expired": 2, "cancelled": 0}
    out, err = await output(store, "t", batch.id)
    assert [x["custom_id"] for x in out] == ["req-0"]
    assert [(x["custom_id"], x["error"]["code"], x["response"]) for x in err] == [
        ("req-1", "batch_expired", None), ("req-2", "batch_expired", None)]


async def test_finalising_races_end_a_batch_once(store: JobStore) -> None:
    batch = await new_batch(store, 1)
    (line,) = await store.claim("w", 1, LEASE_S)
    await store.finish("w", line, 200, {}, "r")
    ended = await asyncio.gather(*(store.finalize_due() for _ in range(4)))
    assert sorted(b for e in ended for b in e) == [batch.id]
    assert len([f for f in await store.list_files("t", 10) if f.purpose == "batch_output"]) == 1


async def test_batches_are_listed_newest_first_per_tenant_with_a_cursor(
        store: JobStore, clock: ManualClock) -> None:
    ids = []
    for _ in range(3):
        ids.append((await new_batch(store, 1)).id)
        clock.advance(1)
    await new_batch(store, 1, tenant="other")
    assert [b.id for b in await store.list_batches("t", 10)] == ids[::-1]
    assert [b.id for b in await store.list_batches("t", 1, after=ids[2])] == [ids[1]]
    assert len(await store.list_batches(None, 10)) == 4
    assert await store.get_batch("other", ids[0]) is None
    progress = await store.progress()
    assert [p.total for p in progress] == [1, 1, 1, 1]


async def test_a_failed_batch_stores_its_errors_and_no_line(store: JobStore) -> None:
    f = await store.add_file("t", "batch", "in.jsonl", b"{}", 1)
    errors = [{"code": "mismatched_endpoint", "line": 1, "message": "m", "param": "url"}]
    batch = await store.create_batch("t", "/v1/embeddings", f.id, "24h", 60, {"k": "v"},
                                     lines(1), errors)
    got = (await store.get_batch("t", batch.id)).to_openai()
    assert got["status"] == "failed" and got["errors"]["data"] == errors
    assert got["metadata"] == {"k": "v"} and got["failed_at"] is not None
    assert await store.claim("w", 10, LEASE_S) == []


def test_input_lines_are_validated_with_their_line_numbers() -> None:
    good = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": "x"}})
    bad_url = good.replace("/v1/completions", "/v1/nope")
    with pytest.raises(InvalidFile) as e:
        parse(f"{good}\nnot json\n\n{bad_url}\n{good}\n".encode(), max_lines=10,
              max_line_bytes=10_000)
    assert [n for n, _ in e.value.errors] == [2, 4, 5]
    assert "repeats line 1" in e.value.errors[2][1]
    with pytest.raises(InvalidFile, match="more than 1 requests"):
        other = good.replace('"a"', '"b"')
        parse(f"{good}\n{other}\n".encode(), max_lines=1, max_line_bytes=10_000)
    with pytest.raises(InvalidFile, match="no requests"):
        parse(b"\n\n", max_lines=10, max_line_bytes=10_000)
    assert [x.custom_id for x in parse(good.encode(), max_lines=1, max_line_bytes=10_000)] == ["a"]
