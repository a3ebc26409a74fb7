"""The simulator's KV-event publisher: vLLM's ``ZmqEventPublisher``
(``vllm/distributed/kv_events.py``) on the simulator's event loop.

Same wire format (:mod:`engines.kv_events`): PUB frames ``(topic, seq as 8-byte
big-endian, msgpack KVEventBatch)`` with ``seq`` counting from 0 in each process,
the last ``buffer_steps`` batches kept for the ROUTER replay socket, which answers
``[b"", start_seq]`` with every buffered batch ``seq >= start_seq`` and the end
marker. Same configuration (``--kv-events-config`` JSON, vLLM's ``KVEventsConfig``
fields): the PUB endpoint is bound when it contains ``*`` or ``::`` or is ``ipc://``
/ ``inproc://`` and connected otherwise; the replay endpoint is always bound.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engines.kv_events import END_SEQ, Event, KVEventBatch, seq_bytes


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` (``vllm/config/kv_events.py``) fields the simulator
    uses, with vLLM's defaults."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the flag's JSON. Unknown fields of vLLM's config are ignored; as in
        vLLM, ``publisher`` defaults to ``zmq`` when events are enabled.

        Raises:
            ValueError: not a JSON object.
        """
        raw: Any = msgspec.json.decode(text)
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        fields = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        if "publisher" not in fields:
            fields["publisher"] = "zmq" if fields.get("enable_kv_cache_events") else "null"
        return cls(**fields)

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class SimEventPublisher:
    """Publishes KV-event batches; serves replays while :meth:`serve_replay` runs.

    Args:
        cfg: endpoints, topic, replay buffer and high-water mark.
        context: ZeroMQ context (default: a new one, terminated by :meth:`close`).
    """

    def __init__(self, cfg: KVEventsConfig, context: zmq.asyncio.Context | None = None) -> None:
        self.cfg = cfg
        self._own = context is None
        self.context = context or zmq.asyncio.Context()
        self._topic = cfg.topic.encode("utf-8")
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._seq = 0
        self.pub = self.context.socket(zmq.PUB)
        self.pub.set_hwm(cfg.hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay: zmq.asyncio.Socket | None = None
        try:
            if _binds(cfg.endpoint):
                self.pub.bind(cfg.endpoint)
            else:
                self.pub.connect(cfg.endpoint)
            if cfg.replay_endpoint:
                self.replay = self.context.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError:  # a port taken: leave no socket bound behind
            self.close()
            raise

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: Sequence[Event], ts: float | None = None) -> int:
        """Send one batch now (never blocks: past the high-water mark ZeroMQ drops it
        for slow subscribers, who then replay). Returns its sequence number."""
        batch = KVEventBatch(ts=time.time() if ts is None else ts, events=list(events),
                             data_parallel_rank=0)
        payload = self._encoder.encode(batch)
        seq = self._seq
        self._seq += 1
        self.pub.send_multipart((self._topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))
        return seq

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled."""
        if self.replay is None:
            return
        while True:
            frames = await self.replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self.replay.send_multipart(
                        (client, b"", self._topic, seq_bytes(seq), payload))
            await self.replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        """Close the sockets (and the context if it was created here)."""
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
        if self._own:
            with contextlib.suppress(zmq.ZMQError):
                self.context.term()

