"""Client connections are bounded: a request head must arrive within
``timeouts.request_head_s`` (silent, partial and dripping heads are closed), and an
idle kept-alive connection is closed after ``timeouts.keepalive_s`` (issue 39,
item 10: silent connections used to stay open forever). Raw sockets, real loopback."""

from __future__ import annotations

import asyncio

from tests.integration.conftest import make_config, run_gateway

HEAD_S, KEEPALIVE_S = 0.5, 1.0
#: generous bound for "closed by the gateway": many times the deadlines, far below the
#: 3630 s aiohttp keeps a silent connection by default
CLOSED_WITHIN_S = 8.0
PARTIAL = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"


async def closed_by_peer(reader: asyncio.StreamReader) -> bytes:
    """Everything the gateway sent until it closed the connection."""
    async with asyncio.timeout(CLOSED_WITHIN_S):
        return await reader.read()


async def test_heads_and_idle_connections_are_bounded(engines) -> None:
    (engine,) = await engines(1)
    cfg = make_config([engine], gateway={
        "timeouts": {"request_head_s": HEAD_S, "keepalive_s": KEEPALIVE_S}})
    async with run_gateway(cfg) as gw:
        host, port = gw.url.removeprefix("http://").split(":")

        async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_connection(host, int(port))

        # silent: connects and sends nothing
        silent = [await connect() for _ in range(20)]
        # partial head, then nothing
        r_partial, w_partial = await connect()
        w_partial.write(PARTIAL)
        # a head that drips one header line at a time and never ends
        r_drip, w_drip = await connect()

        async def drip() -> None:
            w_drip.write(PARTIAL)
            for i in range(200):
                await asyncio.sleep(0.05)
                w_drip.write(f"x-drip-{i}: y\r\n".encode())
        dripping = asyncio.create_task(drip())
        try:
            for reader, _ in silent:
                assert await closed_by_peer(reader) == b""
            assert await closed_by_peer(r_partial) == b""
            assert await closed_by_peer(r_drip) == b""
        finally:
            dripping.cancel()
            for _, writer in [*silent, (r_partial, w_partial), (r_drip, w_drip)]:
                writer.close()

        # a whole request answered, then the connection idles: closed after keepalive_s
        reader, writer = await connect()
        writer.write(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
        first = await reader.readuntil(b"\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 200"), first
        rest = await closed_by_peer(reader)  # the body, then EOF
        assert b"HTTP/1.1" not in rest
        writer.close()

        # a head sent in pieces within the deadline is served
        reader, writer = await connect()
        writer.write(b"GET /health HTTP/1.1\r\n")
        await asyncio.sleep(HEAD_S / 5)
        writer.write(b"Host: gw\r\nConnection: close\r\n\r\n")
        answer = await closed_by_peer(reader)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        writer.close()
