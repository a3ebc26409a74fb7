"""``python -m loadtest faults --json PATH [--quick]``: steady mixed load through
``sluice serve`` while things break, in turn.

The stand: two simulated engines launched by the gateway (``kind: sim``), a private
``redis-server`` as the counter store (fail open), three tenants (interactive,
standard, batch; each with a concurrency limit, requests/min and tokens/min), the
gateway's spans to :class:`loadtest.harness.TraceSink`. ``--concurrency`` clients
(default 12) send chat requests back to back, half streamed, across the tenants.

Faults, each held ``--hold`` s (default 8; ``--quick``: 3) then undone, with a
``baseline`` first:

* ``engine_kill`` — SIGKILL one engine mid-stream (the gateway restarts it; the
  phase lasts until both engines are ready again);
* ``engine_hang`` — one engine stops producing tokens while its ``/health`` stays
  200 (the simulator's SIGUSR1 freeze; SIGUSR2 thaws it);
* ``redis_restart`` — Redis stopped, then started again on the same port (empty);
* ``redis_readonly`` — Redis made a read-only replica (``REPLICAOF`` a port nobody
  listens on, as after a failover), answering every write ``READONLY``, then
  made a primary again;
* ``redis_paused`` — the Redis process stopped (SIGSTOP) while requests end, then
  continued (SIGCONT): the releases made meanwhile must reach it (``leftovers``);
* ``tenants_replace`` — ``tenants.yaml`` replaced atomically (``mv``) by an equal
  file with changed weights; ``tenants_truncate`` — then truncated to 0 bytes
  (a bad file: the running tenants must stay), and restored afterwards;
* ``client_disconnect`` — extra clients open streams and hang up after the first
  chunk (not counted as accepted: they leave on purpose);
* ``slow_reader`` — one extra client with a 4 KiB receive buffer reads a long
  stream 256 bytes every 0.1 s (counted).

Every request the clients sent is ``accepted``; it ``completed`` (200 with a full
answer: JSON with choices, or a stream ending ``[DONE]``), ``failed_cleanly`` (an
OpenAI error status, or a stream ending with an error event and no ``[DONE]``) or
is ``lost`` (anything else: a cut stream, a reset, a non-OpenAI error body, no
answer within ``--request-timeout``; goal 0). ``overshoot_tokens`` is Σ max(0,
settled − reserved) tokens over the gateway's spans (goal 0). Requests count for
the phase in which they ended (``per_fault``). After the load stops, nothing may be
left held (``leftovers``, :func:`loadtest.harness.leftovers`).

Settings changed from the shipped defaults, so that a hung engine shows within a
phase: ``timeouts.first_token_s`` 3, ``idle_s`` 2, ``non_stream_s`` 6 (shipped 120 /
60 / 600 for cold CPU engines); supervisor probes every 0.5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
import yaml

from loadtest.harness import (
    MODEL,
    TraceSink,
    api_key,
    error_problem,
    new_trace,
    settled,
    sim_engines,
    stream_end,
    tenant_entry,
    trace_env,
    write_config,
)
from loadtest.launch import RedisServer, RunningGateway, free_port, gateway
from loadtest.report import write_json

TENANTS = [
    tenant_entry("chat", priority="interactive", max_concurrent=16, requests_per_min=100_000,
                 tokens_per_min=10_000_000),
    tenant_entry("std", priority="standard", max_concurrent=16, requests_per_min=100_000,
                 tokens_per_min=10_000_000),
    tenant_entry("bulk", priority="batch", max_concurrent=16, requests_per_min=100_000,
                 tokens_per_min=10_000_000, max_queue_wait_s=10),
]
WORDS = ["the", "river", "runs", "down", "to", "the", "sea", "past", "old", "mills", "and", "quiet", "towns"]


@dataclass
class Result:
    """One request; ``kind`` is ``completed``, ``failed_cleanly`` or ``lost``."""

    ended_s: float
    kind: str
    status: int
    trace_id: str
    detail: str = ""


def classify(status: int, raw: bytes, streamed: bool) -> tuple[str, str]:
    """(kind, detail) of a finished HTTP exchange."""
    if status != 200:
        problem = error_problem(status, raw)
        return ("lost", problem) if problem else ("failed_cleanly", f"{status}")
    if streamed:
        end = stream_end(raw)
        return {"done": ("completed", ""), "error": ("failed_cleanly", "sse error"),
                "cut": ("lost", f"stream cut: {raw[-160:]!r}")}[end]
    try:
        ok = bool(json.loads(raw)["choices"])
    except (ValueError, KeyError, TypeError):
        ok = False
    return ("completed", "") if ok else ("lost", f"bad JSON answer: {raw[:160]!r}")


def body(rng: random.Random, stream: bool, max_tokens: int) -> dict[str, Any]:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))
    b: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens,
                         "messages": [{"role": "user", "content": text}]}
    if stream:
        b["stream"] = True
        if rng.random() < 0.5:
            b["stream_options"] = {"include_usage": True}
    return b


class Load:
    """The steady load: ``concurrency`` clients sending back to back until stopped."""

    def __init__(self, session: aiohttp.ClientSession, url: str, concurrency: int,
                 timeout_s: float, seed: int) -> None:
        self.session, self.url, self.timeout_s = session, url, timeout_s
        self.results: list[Result] = []
        self.t0 = time.monotonic()
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._client(random.Random(seed + i)))
                       for i in range(concurrency)]

    async def one(self, rng: random.Random, *, max_tokens: int | None = None,
                  stream: bool | None = None) -> Result:
        stream = rng.random() < 0.5 if stream is None else stream
        tenant = rng.choice(TENANTS)["name"]
        trace_id, tp = new_trace()
        headers = {"Authorization": f"Bearer {api_key(tenant)}", **tp}
        b = body(rng, stream, max_tokens or rng.randint(8, 48))
        try:
            async with self.session.post(self.url + "/v1/chat/completions", json=b,
                                         headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                raw = await r.read()
                kind, detail = classify(r.status, raw, stream)
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as e:
            kind, detail, status = "lost", repr(e), 0
        return Result(time.monotonic() - self.t0, kind, status, trace_id, detail)

    async def _client(self, rng: random.Random) -> None:
        while not self._stop.is_set():
            self.results.append(await self.one(rng))

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


# ----------------------------------------------------------------------------- extra clients


async def disconnecting_client(session: aiohttp.ClientSession, url: str, rng: random.Random,
                               stop: asyncio.Event) -> int:
    """Open streams and hang up after the first chunk until ``stop``; returns how many."""
    n = 0
    while not stop.is_set():
        tenant = rng.choice(TENANTS)["name"]
        try:
            async with session.post(url + "/v1/chat/completions", json=body(rng, True, 64),
                                    headers={"Authorization": f"Bearer {api_key(tenant)}"}) as r:
                if r.status == 200:
                    await r.content.readany()
                r.close()  # drop the connection mid-stream
        except aiohttp.ClientError:
            pass
        n += 1
        await asyncio.sleep(0.05)
    return n


def dechunk(data: bytes) -> bytes:
    """The payload of an HTTP/1.1 chunked body (RFC 9112 §7.1); a truncated body
    gives what arrived."""
    out, pos = bytearray(), 0
    while (eol := data.find(b"\r\n", pos)) != -1:
        size = int(data[pos:eol].split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += data[eol + 2:eol + 2 + size]
        pos = eol + 2 + size + 2
    return bytes(out)


async def slow_read(url: str, t0: float, rng: random.Random, *, chunk: int = 256,
                    every_s: float = 0.1, timeout_s: float = 120) -> Result:
    """One streamed request read through a 4 KiB receive buffer, ``chunk`` bytes
    every ``every_s``."""
    host, port = url.removeprefix("http://").split(":")
    trace_id, tp = new_trace()
    payload = json.dumps(body(rng, True, 200)).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nAuthorization: Bearer {api_key('std')}\r\n"
            f"traceparent: {tp['traceparent']}\r\nContent-Length: {len(payload)}\r\n\r\n")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    raw = b""
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
            reader, writer = await asyncio.open_connection(sock=sock)
            writer.write(head.encode() + payload)
            await writer.drain()
            while piece := await reader.read(chunk):
                raw += piece
                await asyncio.sleep(every_s)
            writer.close()
    except (OSError, TimeoutError) as e:
        return Result(time.monotonic() - t0, "lost", 0, trace_id, f"slow reader: {e!r}")
    head_end = raw.find(b"\r\n\r\n")
    status = int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else 0
    payload_in = raw[head_end + 4:]
    if status == 200:
        kind, detail = classify(200, dechunk(payload_in), True)
    else:
        kind, detail = ("lost", "no HTTP status") if not status else ("failed_cleanly", "")
    return Result(time.monotonic() - t0, kind, status, trace_id, "slow reader " + detail)


# ----------------------------------------------------------------------------- faults


async def wait_engines_ready(session: aiohttp.ClientSession, gw: RunningGateway, n: int,
                             timeout_s: float = 60) -> None:
    """Until ``n`` engines report ready in ``sluice_engine_up``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        async with session.get(gw.url + "/metrics") as r:
            up = sum(float(line.rsplit(" ", 1)[1]) for line in (await r.text()).splitlines()
                     if line.startswith("sluice_engine_up{"))
        if up >= n:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"fewer than {n} engines ready after {timeout_s} s")


Fault = Callable[[], Awaitable[None]]


def make_faults(gw: RunningGateway, redis: RedisServer, cfg_dir: Path,
                session: aiohttp.ClientSession, load: Load, hold_s: float,
                extra: list[Result]) -> dict[str, Fault]:
    tenants_path = cfg_dir / "tenants.yaml"
    original = tenants_path.read_text()

    async def engine_kill() -> None:
        victim = gw.engine_processes()[0]
        await asyncio.sleep(1.0)  # let streams start on it
        victim.send_signal(signal.SIGKILL)
        await asyncio.sleep(hold_s)
        await wait_engines_ready(session, gw, 2)

    async def engine_hang() -> None:
        victim = gw.engine_processes()[0]
        victim.send_signal(signal.SIGUSR1)
        try:
            await asyncio.sleep(hold_s)
        finally:
            victim.send_signal(signal.SIGUSR2)
        await wait_engines_ready(session, gw, 2)

    async def redis_restart() -> None:
        redis.stop()
        await asyncio.sleep(hold_s)
        redis.start()

    async def redis_readonly() -> None:
        client = aioredis.Redis.from_url(redis.url)
        try:
            await client.replicaof("127.0.0.1", str(free_port()))
            await asyncio.sleep(hold_s)
        finally:
            await client.replicaof("NO", "ONE")
            await client.aclose()

    async def redis_paused() -> None:
        assert redis.proc is not None
        redis.proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(hold_s)
        finally:
            redis.proc.send_signal(signal.SIGCONT)

    async def tenants_replace() -> None:
        doc = yaml.safe_load(original)
        for t in doc["tenants"]:
            t["weight"] = 2.0
        tmp = cfg_dir / ".tenants.yaml.new"
        tmp.write_text(yaml.safe_dump(doc))
        os.replace(tmp, tenants_path)
        await asyncio.sleep(hold_s)

    async def tenants_truncate() -> None:
        with tenants_path.open("w"):
            pass
        try:
            await asyncio.sleep(hold_s)
        finally:
            tmp = cfg_dir / ".tenants.yaml.new"
            tmp.write_text(original)
            os.replace(tmp, tenants_path)
            await asyncio.sleep(1.0)

    async def client_disconnect() -> None:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(disconnecting_client(session, gw.url, random.Random(i),
                                                          stop)) for i in range(4)]
        await asyncio.sleep(hold_s)
        stop.set()
        n = sum(await asyncio.gather(*tasks))
        print(f"client_disconnect: {n} streams dropped on purpose", file=sys.stderr)

    async def slow_reader() -> None:
        extra.append(await slow_read(gw.url, load.t0, random.Random(7)))
        await asyncio.sleep(max(0.0, hold_s / 2))

    return {f.__name__: f for f in (engine_kill, engine_hang, redis_restart, redis_readonly,
                                   redis_paused, tenants_replace, tenants_truncate,
                                   client_disconnect, slow_reader)}


# ----------------------------------------------------------------------------- run


def counts(results: list[Result], traces: dict[str, Any]) -> dict[str, int]:
    kinds = Counter(r.kind for r in results)
    return {"accepted": len(results), "completed": kinds["completed"],
            "failed_cleanly": kinds["failed_cleanly"], "lost": kinds["lost"],
            "overshoot_tokens": sum(traces[r.trace_id].overshoot for r in results
                                    if r.trace_id in traces)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="sluice-faults-"))
    hold = 3.0 if args.quick else args.hold
    redis = RedisServer()
    redis.start()
    sink = await TraceSink().start()
    trace_env()
    phases: list[tuple[str, float]] = []  # (name, start s)
    extra: list[Result] = []
    try:
        cfg = write_config(
            out_dir / "config", engines=sim_engines(2, args.speed), tenants=TENANTS,
            gateway={"limits": {"store_url": redis.url, "redis_failure": "open"},
                     "observability": {"access_log": False, "tracing": True,
                                       "otlp_endpoint": sink.url},
                     "timeouts": {"first_token_s": 3, "idle_s": 2, "non_stream_s": 6}},
            supervisor={"failure_threshold": 2, "probe_timeout_s": 1.0},
            saturation={"max_waiting": 1000})
        with gateway(cfg, log_path=out_dir / "gateway.log", ready_timeout_s=60) as gw:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                load = Load(session, gw.url, args.concurrency, args.request_timeout, args.seed)
                faults = make_faults(gw, redis, cfg, session, load, hold, extra)
                phases.append(("baseline", 0.0))
                await asyncio.sleep(hold)
                for name, fault in faults.items():
                    phases.append((name, time.monotonic() - load.t0))
                    print(f"{phases[-1][1]:6.1f} s: {name}", file=sys.stderr, flush=True)
                    await fault()
                    await asyncio.sleep(1.0)
                await load.stop()
                left = await settled(session, gw.url, gw.engine_urls(), redis.url, timeout_s=15)
                results = load.results + extra
                missing = await sink.wait_for([r.trace_id for r in results], timeout_s=15)
    finally:
        await sink.stop()
        redis.stop()

    def phase_of(r: Result) -> str:
        return [name for name, start in phases if start <= r.ended_s][-1]

    report: dict[str, Any] = counts(results, sink.traces)
    report["per_fault"] = {name: counts([r for r in results if phase_of(r) == name],
                                        sink.traces) for name, _ in phases}
    report["leftovers"] = left
    report["wall_s"] = round(time.monotonic() - load.t0, 1)
    for r in [r for r in results if r.kind == "lost"][:args.examples]:
        print(f"LOST in {phase_of(r)} (status {r.status}): {r.detail[:300]}", file=sys.stderr)
    statuses = Counter(f"{phase_of(r)}:{r.status}" for r in results if r.kind != "completed")
    over = [sink.traces[r.trace_id] for r in results if r.trace_id in sink.traces
            and sink.traces[r.trace_id].overshoot]
    print(f"not completed by phase:status {dict(sorted(statuses.items()))}; "
          f"{len(missing)} requests without a trace; {len(over)} overshot their reservation "
          f"({sum(t.output_tokens > (t.reserved or 0) for t in over)} by output alone); "
          f"e.g. {over[:3]}", file=sys.stderr)
    return report


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest faults",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="report path")
    p.add_argument("--quick", action="store_true", help="hold each fault 3 s")
    p.add_argument("--hold", type=float, default=8.0, help="seconds each fault lasts")
    p.add_argument("--concurrency", type=int, default=12, help="steady clients")
    p.add_argument("--speed", type=float, default=10.0, help="simulator speed factor")
    p.add_argument("--request-timeout", type=float, default=60.0,
                   help="client timeout, s; a request past it is lost")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--examples", type=int, default=10, help="lost requests printed")
    p.add_argument("--out-dir", help="config and gateway log (default: a temp dir)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    write_json(args.json, asyncio.run(run(args)))
    return 0
