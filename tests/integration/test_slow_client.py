"""A client that stops reading a streamed answer is disconnected after
``timeouts.client_write_s``: its request ends, the engine request is closed and the
tenant's concurrency slot is freed (a write the client never takes is a wait the
client controls; it was bounded only by the engine idle timeout, and the error event
written after it could block forever)."""

from __future__ import annotations

import asyncio
import json
import socket

from gateway.keys import LIMITER, OBSERVERS
from limits.outcome import Outcome
from tests.integration.conftest import make_config, run_gateway
from tests.integration.limits_support import auth, tenant
from tests.support import wait_for


async def test_client_that_stops_reading_is_let_go(engines) -> None:
    # ~6 MB of SSE: more than the loopback socket buffers and the transport's buffer
    (engine,) = await engines(1, reply=" ".join(f"word{i:06d}" for i in range(60_000)))
    tenants = {"tenants": [tenant("t", max_concurrent=1)]}
    cfg = make_config([engine], tenants=tenants,
                      gateway={"timeouts": {"client_write_s": 0.5, "idle_s": 600}})
    async with run_gateway(cfg) as gw:
        outcomes: list[Outcome] = []
        gw.app[OBSERVERS].append(lambda rec: outcomes.append(rec.outcome))
        host, port = gw.url.removeprefix("http://").split(":")
        payload = json.dumps({"model": "fake-model", "stream": True,
                              "messages": [{"role": "user", "content": "talk"}]}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
                f"Authorization: {auth('t')['Authorization']}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
        await asyncio.get_running_loop().sock_sendall(sock, head.encode() + payload)
        gw.sent += 1  # counted like gw.post's requests, for gw.idle()
        try:
            await wait_for(lambda: gw.finished >= 1, timeout_s=15,
                           what="the gateway to give up on the client that does not read")
            assert outcomes == [Outcome.CLIENT_DISCONNECTED]
            assert gw.app[LIMITER].held_slots == 0
            await wait_for(lambda: engine.running == 0, what="the engine request closed")
        finally:
            sock.close()
        async with await gw.post("/v1/chat/completions", {
                "model": "fake-model", "max_tokens": 3,
                "messages": [{"role": "user", "content": "hi"}]}, headers=auth("t")) as r:
            assert r.status == 200, await r.text()  # the slot is free again
        await gw.idle()
