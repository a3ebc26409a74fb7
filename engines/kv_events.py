"""KV-cache events: vLLM's wire format and one subscriber per engine.

With ``--kv-events-config`` an engine publishes what its prefix cache stores and
evicts. The format is vLLM's (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``):

* a ZeroMQ PUB socket sends three frames per batch: ``topic`` (UTF-8),
  ``seq`` (8-byte big-endian, 0, 1, 2 … per publisher process) and ``payload``,
  a msgpack ``KVEventBatch`` encoded by msgspec: an array ``[ts, events,
  data_parallel_rank]`` whose events are maps tagged ``"type": "BlockStored" |
  "BlockRemoved" | "AllBlocksCleared"``;
* a ROUTER replay socket answers a request ``[b"", start_seq (8-byte big-endian)]``
  with one ``[b"", topic, seq, payload]`` message per buffered batch whose
  ``seq >= start_seq`` (the last ``buffer_steps`` batches, default 10,000), then the
  end marker ``[b"", b"", (-1 as signed 8-byte big-endian), b""]``.

The structs below mirror vLLM's field for field (same class names, hence the same
tags), so they decode what vLLM sends and vLLM decodes what the simulator sends
(``tests/contract/test_kv_events.py`` checks both against bytes vLLM 0.32 encoded).

:class:`KVEventSubscriber` follows one engine: it applies batches in sequence order
to a :class:`KVEventSink` (the precise prefix index), asks the replay socket for
missed batches on a gap, recognises a restarted publisher (the sequence starts
again), and tells the sink the engine is not *synced* — its entries may be wrong, use
the approximate index — whenever it cannot know the engine's cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from limits.clock import MONOTONIC
from limits.interfaces import Clock

if TYPE_CHECKING:
    from engines.pool import Engine

log = logging.getLogger(__name__)

#: A block hash as vLLM publishes it: a 64-bit int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
#: the default) or the raw digest bytes.
ExternalBlockHash = int | bytes

#: The replay socket's end-of-replay sequence number (``ZmqEventPublisher.END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the tagged event union (``vllm.distributed.kv_events.KVCacheEvent``)."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache: ``block_hashes`` (engine hashes, in
    chain order) cover ``token_ids`` (``block_size`` tokens each); the first block's
    parent is ``parent_block_hash`` (None: the blocks start the prompt).
    ``extra_keys``: per block, what else the engine hashed (LoRA name, multimodal
    ``(id, offset)`` pairs, the ``cache_salt`` string — first block only)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache (evicted for reuse)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """One published batch: ``ts`` (engine wall clock, s since the epoch), the
    events of one engine step, the data-parallel rank (None: not set)."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload frame.

    Raises:
        msgspec.DecodeError: not a ``KVEventBatch``.
    """
    return _decoder.decode(payload)


def seq_bytes(seq: int) -> bytes:
    """A sequence number as its 8-byte big-endian frame."""
    return seq.to_bytes(8, "big", signed=seq < 0)


@dataclass(frozen=True)
class EventsEndpoint:
    """Where one engine publishes: ``endpoint`` (the PUB socket, as a subscriber
    connects to it: ``tcp://host:port`` or ``ipc://path``), ``replay`` (its ROUTER socket, or None),
    ``topic`` (frames of other topics are ignored; "" takes all)."""

    endpoint: str
    replay: str | None = None
    topic: str = ""


class KVEventSink(Protocol):
    """What a subscriber feeds (:class:`engines.prefix_events.EventPrefixIndex`)."""

    def apply(self, engine: Engine, events: Sequence[Event]) -> None:
        """Apply one batch's events, in order."""
        ...

    def clear(self, engine: Engine) -> None:
        """Forget everything known about ``engine``'s cache."""
        ...

    def set_synced(self, engine: Engine, synced: bool) -> None:
        """Whether ``engine``'s entries are complete (else use the fallback)."""
        ...


#: After a loss the replay socket could not fill, the engine's entries stay marked
#: unsynced this long, s, while new events rebuild them: long enough for the
#: blocks of the requests running then to be stored again or to age out of the
#: approximate index's view. A guess, not a measured figure.
RESYNC_S = 30.0
#: How long one replay request may take, s.
REPLAY_TIMEOUT_S = 1.0
#: Recent batch digests kept to tell a duplicate (a batch seen live and by replay)
#: from a restarted publisher reusing the sequence numbers.
RECENT_BATCHES = 1024


def _digest(payload: bytes) -> bytes:
    return blake2b(payload, digest_size=16).digest()


class KVEventSubscriber:
    """Follows one engine's KV events into ``sink``.

    Sequence rules, per received batch ``seq``:

    * the next expected one → applied;
    * a later one (a gap: the PUB socket dropped batches, or the subscriber joined
      late) → the replay socket is asked for everything from the last applied batch
      on. If the first batch it returns is the one last applied (same ``seq``, same
      payload digest), the missing ones are applied and nothing was lost;
    * an earlier one that is not a duplicate, or a replay that does not start with
      the last applied batch → the publisher restarted (a new engine process, an
      empty cache): the engine's entries are cleared and the replay socket asked for
      everything from ``seq`` 0;
    * a loss the replay cannot fill (no replay socket, no answer within
      :data:`REPLAY_TIMEOUT_S`, its buffer no longer reaches back) → entries
      cleared and the engine marked unsynced for :data:`RESYNC_S` while new events
      rebuild them.

    The SUB socket's monitor reports connects and disconnects: while disconnected
    (the publisher died, the engine is restarting) the engine is unsynced; on
    (re)connect the subscriber replays as for a gap, which also tells a restarted
    publisher from the same one. Until the first successful replay or ``seq`` 0 the
    engine is unsynced too (the subscriber may have joined an engine with history).

    Args:
        engine: the pool entry (the sink keys entries on it).
        endpoint: where it publishes.
        sink: receives events and sync state.
        context: ZeroMQ context (default: the process's shared instance).
        clock: the clock (:data:`limits.clock.MONOTONIC`), s.
        resync_s: :data:`RESYNC_S`.
        replay_timeout_s: :data:`REPLAY_TIMEOUT_S`.

    Attributes (counters, for tests and metrics): ``batches`` applied, ``replayed``
    batches applied from the replay socket, ``restarts`` seen, ``losses`` the replay
    could not fill, ``decode_errors``.
    """

    def __init__(self, engine: Engine, endpoint: EventsEndpoint, sink: KVEventSink, *,
                 context: zmq.asyncio.Context | None = None,
                 clock: Clock = MONOTONIC,
                 resync_s: float = RESYNC_S, replay_timeout_s: float = REPLAY_TIMEOUT_S) -> None:
        self.engine = engine
        self.endpoint = endpoint
        self.sink = sink
        self.context = context or zmq.asyncio.Context.instance()
        self.clock = clock
        self.resync_s = resync_s
        self.replay_timeout_s = replay_timeout_s
        self.last_seq: int | None = None
        self.synced = False
        self.connected = False
        self._resync_at: float | None = None
        self._recent: OrderedDict[int, bytes] = OrderedDict()
        self.batches = self.replayed = self.restarts = self.losses = self.decode_errors = 0
        #: Set after every batch applied or state change (tests wait on it).
        self.changed = asyncio.Event()

    # -------------------------------------------------------------- the loop

    async def run(self) -> None:
        """Subscribe and follow until cancelled."""
        topic = self.endpoint.topic.encode("utf-8")
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        sub.setsockopt(zmq.LINGER, 0)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())
                    await self._on_monitor(event["event"])
                if sub in ready:
                    frames = await sub.recv_multipart()
                    if len(frames) == 3 and len(frames[1]) == 8:
                        await self._on_batch(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _on_monitor(self, event: int) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            self._set_synced(False)
        elif event == zmq.EVENT_CONNECTED:
            self.connected = True
            await self._resync()

    async def _on_batch(self, seq: int, payload: bytes) -> None:
        last = self.last_seq
        if last is not None and seq <= last:
            if self._recent.get(seq) == _digest(payload):
                return  # already applied (seen by replay first)
            self._restart()
            await self._resync()
        elif last is None and seq != 0 or last is not None and seq > last + 1:
            await self._resync()
        if self.last_seq is None or self.last_seq == seq - 1:
            self._apply(seq, payload)
        self._maybe_synced()

    # -------------------------------------------------------------- replay

    async def _resync(self) -> None:
        """Fill what is missing from the replay socket (see class doc)."""
        if self.last_seq is not None:
            got = await self._replay_from(self.last_seq)
            if got is None:
                return self._lost()
            if got and got[0][0] == self.last_seq and _digest(got[0][1]) == self._recent.get(
                    self.last_seq):
                self._apply_replayed(got[1:])
                return self._maybe_synced(fresh=self._resync_at is None)
            self._restart()
        got = await self._replay_from(0)
        if got is None:
            return self._lost()
        if got and got[0][0] != 0:
            self._lost()
        self._apply_replayed(got)
        self._maybe_synced(fresh=self._resync_at is None)

    def _apply_replayed(self, got: list[tuple[int, bytes]]) -> None:
        for seq, payload in got:
            if self.last_seq is None or seq == self.last_seq + 1:
                self._apply(seq, payload)
                self.replayed += 1

    async def _replay_from(self, start: int) -> list[tuple[int, bytes]] | None:
        """Batches ``seq >= start`` from the replay socket, in order; None when there
        is none or it does not answer in time."""
        if self.endpoint.replay is None:
            return None
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint.replay)
        out: list[tuple[int, bytes]] = []
        try:
            async with asyncio.timeout(self.replay_timeout_s):
                await sock.send_multipart([b"", seq_bytes(start)])
                while True:
                    frames = await sock.recv_multipart()
                    if len(frames) != 4 or frames[2] == END_SEQ:
                        return out
                    out.append((int.from_bytes(frames[2], "big"), frames[3]))
        except TimeoutError:
            log.warning("engine %s: KV-event replay from %s timed out", self.engine.id,
                        self.endpoint.replay)
            return None
        finally:
            sock.close(linger=0)

    # -------------------------------------------------------------- state

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        self._recent[seq] = _digest(payload)
        while len(self._recent) > RECENT_BATCHES:
            self._recent.popitem(last=False)
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError as e:
            self.decode_errors += 1
            log.warning("engine %s: undecodable KV-event batch %d: %s", self.engine.id, seq, e)
            return self._lost()
        self.sink.apply(self.engine, batch.events)
        self.batches += 1
        self.changed.set()

    def _restart(self) -> None:
        self.restarts += 1
        self.last_seq = None
        self._recent.clear()
        self.sink.clear(self.engine)
        self.changed.set()

    def _lost(self) -> None:
        """A loss that cannot be filled: start over from what comes next."""
        self.losses += 1
        self.last_seq = None
        self._recent.clear()
        self.sink.clear(self.engine)
        self._resync_at = self.clock.now() + self.resync_s
        self._set_synced(False)

    def _maybe_synced(self, fresh: bool = False) -> None:
        if self._resync_at is not None and self.clock.now() >= self._resync_at:
            self._resync_at, fresh = None, True
        if fresh and self._resync_at is None and self.connected:
            self._set_synced(True)

    def _set_synced(self, synced: bool) -> None:
        if synced != self.synced:
            self.synced = synced
            self.sink.set_synced(self.engine, synced)
        self.changed.set()


class KVEventSubscribers:
    """One :class:`KVEventSubscriber` task per engine that publishes events; also a
    Prometheus collector of their state (:meth:`collect`).

    Args:
        sink: what every subscriber feeds.
        context: ZeroMQ context (default: the process's shared instance).
    """

    def __init__(self, sink: KVEventSink, context: zmq.asyncio.Context | None = None) -> None:
        self.sink = sink
        self.context = context
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def follow(self, engines: Sequence[Engine]) -> None:
        """Start following each of ``engines`` with an endpoint not yet followed."""
        for engine in engines:
            if engine.kv_events is None or engine.id in self._tasks:
                continue
            sub = KVEventSubscriber(engine, engine.kv_events, self.sink, context=self.context)
            self.subscribers[engine.id] = sub
            self._tasks[engine.id] = asyncio.create_task(sub.run(), name=f"kv-events:{engine.id}")

    def unfollow(self, engine: Engine) -> None:
        """Stop following ``engine`` (it left the pool); its sockets close as the
        cancelled task ends (:meth:`stop` waits for any still closing)."""
        task = self._tasks.pop(engine.id, None)
        self.subscribers.pop(engine.id, None)
        if task is not None:
            task.cancel()
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def stop(self) -> None:
        """Cancel every subscriber and wait for its sockets to close."""
        for task in self._tasks.values():
            task.cancel()
        for task in [*self._tasks.values(), *self._closing]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self.subscribers.clear()

    def collect(self) -> Iterator[Any]:
        """Prometheus families (``prometheus_client`` custom collector), per followed
        engine: ``sluice_engine_kv_events_synced`` (1 while its events are trusted,
        0 while the approximate index stands in) and the subscriber's counters
        ``sluice_engine_kv_events_batches``, ``…_replayed``, ``…_losses`` and
        ``…_restarts`` (``_total`` added on exposition)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["engine", "model"]
        synced = GaugeMetricFamily("sluice_engine_kv_events_synced",
                                   "1 while the engine's KV events are in sync, else 0.",
                                   labels=labels)
        counters = {name: CounterMetricFamily(f"sluice_engine_kv_events_{name}", text,
                                              labels=labels)
                    for name, text in (("batches", "KV-event batches applied."),
                                       ("replayed", "Batches recovered from the replay socket."),
                                       ("losses", "Losses the replay socket could not fill."),
                                       ("restarts", "Publisher restarts seen."))}
        for sub in self.subscribers.values():
            values = [sub.engine.id, sub.engine.model]
            synced.add_metric(values, 1.0 if sub.synced else 0.0)
            for name, family in counters.items():
                family.add_metric(values, getattr(sub, name))
        yield synced
        yield from counters.values()
