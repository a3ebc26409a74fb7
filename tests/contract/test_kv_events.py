"""Contract of the KV-event subscriber against the simulator's publisher, over real
ZeroMQ sockets on loopback: vLLM's wire format both ways, ordered batches, a dropped
batch recovered from the replay socket, an engine restart (a new publisher on the
same ports, sequence from 0), a publisher that dies, a loss without a replay socket.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from engines.blocks import chain_block_hashes
from engines.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventsEndpoint,
    KVEventBatch,
    KVEventSubscriber,
    decode_batch,
)
from engines.pool import Engine
from engines.prefix_events import EventPrefixIndex
from loadtest.launch import free_port
from loadtest.sim_engine.kv_events import KVEventsConfig, SimEventPublisher
from tests.support import ManualClock

FIXTURE = Path(__file__).parents[1] / "fixtures" / "vllm_0.32_kv_event_batch.msgpack"
TOKENS = list(range(1000, 1032))  # 8 blocks of 4
KEYS = chain_block_hashes(TOKENS, 4)


def stored(hashes, start: int, parent=None) -> BlockStored:
    n = len(hashes)
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent,
                       token_ids=TOKENS[start * 4:(start + n) * 4], block_size=4, lora_id=None,
                       medium="GPU", lora_name=None, extra_keys=[None] * n)


def test_wire_format_is_vllms():
    """Bytes vLLM 0.32 encoded (``KVEventBatch`` of ``vllm.distributed.kv_events``,
    msgspec msgpack) decode into our structs, and ours encode to the same bytes."""
    raw = FIXTURE.read_bytes()
    batch = decode_batch(raw)
    first, second, removed, cleared = batch.events
    assert batch.ts == 1764500000.25 and batch.data_parallel_rank == 0
    assert first.block_hashes == [11, 12] and first.parent_block_hash is None
    assert first.token_ids == list(range(1, 9)) and first.block_size == 4
    assert first.extra_keys == [("tenant-a",), None] and first.medium == "CPU"
    assert second.parent_block_hash == 12 and second.token_ids == [9, 10, 11, 12]
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [13]
    assert isinstance(cleared, AllBlocksCleared)
    ours = KVEventBatch(ts=1764500000.25, data_parallel_rank=0, events=[
        BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(1, 9)),
                    block_size=4, lora_id=None, medium="CPU", lora_name=None,
                    extra_keys=[("tenant-a",), None], group_idx=0),
        BlockStored(block_hashes=[13], parent_block_hash=12, token_ids=[9, 10, 11, 12],
                    block_size=4, lora_id=None, medium="CPU", lora_name=None, group_idx=0),
        BlockRemoved(block_hashes=[13], medium="CPU", group_idx=0), AllBlocksCleared()])
    assert msgspec.msgpack.encode(ours) == raw


class Harness:
    """One engine, its index, a subscriber task, and publishers on fixed ports."""

    def __init__(self, replay: bool = True) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub_port, self.replay_port = free_port(), free_port()
        self.replay = replay
        self.engine = Engine("e0", "m", "http://127.0.0.1:1")
        self.index = EventPrefixIndex()
        self.clock = ManualClock(0.0)
        endpoint = EventsEndpoint(
            f"tcp://127.0.0.1:{self.pub_port}",
            f"tcp://127.0.0.1:{self.replay_port}" if replay else None, "kv@e0")
        self.sub = KVEventSubscriber(self.engine, endpoint, self.index, context=self.ctx,
                                     clock=self.clock, resync_s=30.0)
        self.publisher: SimEventPublisher | None = None
        self._tasks: list[asyncio.Task] = []

    def start_publisher(self) -> SimEventPublisher:
        cfg = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{self.pub_port}",
            replay_endpoint=f"tcp://127.0.0.1:{self.replay_port}" if self.replay else None,
            topic="kv@e0")
        self.publisher = SimEventPublisher(cfg, self.ctx)
        self._tasks.append(asyncio.create_task(self.publisher.serve_replay()))
        return self.publisher

    async def stop_publisher(self) -> None:
        """Close the publisher and wait until ZeroMQ's I/O thread has released its
        ports (its monitor's ``EVENT_CLOSED``), so that a restart can bind them."""
        assert self.publisher is not None
        self._tasks.pop().cancel()
        bound = [s for s in (self.publisher.pub, self.publisher.replay) if s is not None]
        monitors = [s.get_monitor_socket(zmq.EVENT_CLOSED) for s in bound]
        self.publisher.close()
        self.publisher = None
        async with asyncio.timeout(10):
            for monitor in monitors:
                while (await recv_monitor_message(monitor))["event"] != zmq.EVENT_CLOSED:
                    pass
                monitor.close(linger=0)

    async def until(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                self.sub.changed.clear()
                await self.sub.changed.wait()

    def match(self) -> int:
        return self.index.match(self.engine, KEYS, self.clock.now())


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    h = Harness()
    task = asyncio.create_task(h.sub.run())
    yield h
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    for t in h._tasks:
        t.cancel()
    if h.publisher is not None:
        h.publisher.close()
    h.ctx.destroy(linger=0)  # a failed test may leave a socket open: term() would wait


async def test_ordered_batches(harness: Harness):
    pub = harness.start_publisher()
    await harness.until(lambda: harness.sub.synced)  # connected, replay: nothing yet
    pub.publish([stored([b"a", b"b"], 0)])
    pub.publish([stored([b"c", b"d"], 2, parent=b"b")])
    pub.publish([BlockRemoved([b"d"], "GPU")])
    await harness.until(lambda: harness.sub.batches == 3)
    assert harness.sub.last_seq == 2 and harness.sub.replayed == 0
    assert harness.match() == 3 and harness.index.entries("e0") == 3


class DropOne:
    """Stands between the publisher and its PUB socket and swallows one sequence
    number, as a PUB socket past its high-water mark drops a batch."""

    def __init__(self, sock, seq: int) -> None:
        self.sock, self.seq = sock, seq.to_bytes(8, "big")

    def send_multipart(self, frames, flags=0):
        if frames[1] != self.seq:
            return self.sock.send_multipart(frames, flags=flags)
        return None

    def __getattr__(self, name: str):  # close, get_monitor_socket: the socket's
        return getattr(self.sock, name)


async def test_dropped_batch_is_recovered_from_replay(harness: Harness):
    pub = harness.start_publisher()
    await harness.until(lambda: harness.sub.synced)
    pub.pub = DropOne(pub.pub, 1)
    pub.publish([stored([b"a", b"b"], 0)])
    pub.publish([stored([b"c", b"d"], 2, parent=b"b")])  # never reaches the SUB socket
    pub.publish([stored([b"e"], 4, parent=b"d")])
    await harness.until(lambda: harness.sub.batches == 3)
    assert harness.sub.replayed >= 2  # batches 1 and 2 came from the replay socket
    assert harness.sub.losses == 0 and harness.sub.synced
    assert harness.match() == 5


async def test_engine_restart_clears_and_resyncs(harness: Harness):
    pub = harness.start_publisher()
    await harness.until(lambda: harness.sub.synced)
    pub.publish([stored([b"a", b"b", b"c"], 0)])
    await harness.until(lambda: harness.sub.batches == 1)
    assert harness.match() == 3
    await harness.stop_publisher()
    await harness.until(lambda: not harness.sub.synced)  # disconnect seen
    pub = harness.start_publisher()  # a new process: seq from 0, empty cache
    pub.publish([stored([b"x"], 0)])
    pub.publish([stored([b"y"], 1, parent=b"x")])
    await harness.until(lambda: harness.sub.synced and harness.sub.batches == 3)
    assert harness.sub.restarts == 1 and harness.sub.last_seq == 1
    assert harness.match() == 2 and harness.index.entries("e0") == 2  # a, b, c gone


async def test_publisher_that_dies_falls_back_to_approximate(harness: Harness):
    pub = harness.start_publisher()
    await harness.until(lambda: harness.sub.synced)
    pub.publish([stored([b"a"], 0)])
    await harness.until(lambda: harness.sub.batches == 1)
    harness.index.record(harness.engine, KEYS[:6], now=0.0)  # routing history
    assert harness.match() == 6  # synced: the engine's report or a route just made
    harness.clock.advance(60.0)  # the route prediction has expired; routing history has not
    assert harness.match() == 1
    await harness.stop_publisher()
    await harness.until(lambda: not harness.sub.synced)
    assert harness.match() == 6  # the approximate index answers
    assert not harness.sub.connected


async def test_loss_without_replay_socket_stays_unsynced_for_resync_s():
    h = Harness(replay=False)
    task = asyncio.create_task(h.sub.run())
    try:
        pub = h.start_publisher()
        await h.until(lambda: h.sub.connected and h.sub.losses == 1)  # history unknown
        assert not h.sub.synced
        # without a replay socket nothing recovers a batch sent before the subscription
        # reached the publisher (ZeroMQ's "slow joiner"): send until one arrives
        for _ in range(50):
            pub.publish([stored([b"a", b"b"], 0)])
            with contextlib.suppress(TimeoutError):
                await h.until(lambda: h.sub.batches == 1, timeout_s=0.1)
                break
        assert h.sub.batches == 1 and h.sub.losses == 1
        assert not h.sub.synced and h.index.entries("e0") == 2
        h.clock.advance(31.0)  # resync_s later, the rebuilt entries are trusted
        pub.publish([stored([b"c"], 2, parent=b"b")])
        await h.until(lambda: h.sub.synced)
        assert h.match() == 3
        pub.pub = DropOne(pub.pub, pub.next_seq)
        pub.publish([stored([b"d"], 3, parent=b"c")])  # lost for good
        pub.publish([stored([b"e"], 4, parent=b"d")])
        await h.until(lambda: h.sub.losses == 2)
        assert not h.sub.synced and h.index.entries("e0") == 0  # cleared; e is unanchored
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await h.stop_publisher()
        h.ctx.destroy(linger=0)
