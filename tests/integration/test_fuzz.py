"""Fuzz: hypothesis-generated hostile and odd OpenAI requests (``loadtest.fuzz``)
against a live ``sluice serve`` in front of two simulated engines, one at a time.

For every example: no 5xx but load shedding, every error an OpenAI error object, a
stream ends with ``[DONE]`` or an error event; once the request has ended nothing is
left held (engine leases, queue entries, Redis concurrency leases, engine requests);
the tokens the gateway settled do not exceed what it reserved (from its spans).
A failure is shrunk by hypothesis to a minimal request.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings

from loadtest.fuzz import FuzzRequest, describe, requests, send, stand_config
from loadtest.harness import TRACE_ENV, TraceSink, leftovers, new_trace, settled
from loadtest.launch import gateway

# load: fixed-size fuzz and fault runs against a live gateway
pytestmark = [pytest.mark.timeout(600), pytest.mark.load]


class Stand:
    """The gateway, the trace sink and an aiohttp session on a background event loop
    (hypothesis runs the test body synchronously)."""

    def __init__(self, tmp: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.sink = self.run(TraceSink().start())
        self.session = self.run(self._session())
        self.tmp = tmp

    async def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession()

    def run(self, coro: Any, timeout_s: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.run(self.session.close())
        self.run(self.sink.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def stand(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stand, Any]]:
    tmp = tmp_path_factory.mktemp("fuzz")
    s = Stand(tmp)
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in TRACE_ENV.items():
                mp.setenv(k, v)
            cfg = stand_config(tmp / "config", s.sink.url)
            with gateway(cfg, log_path=tmp / "gateway.log", ready_timeout_s=60) as gw:
                yield s, gw
    finally:
        s.close()


@settings(max_examples=600, deadline=None, database=None,  # ~60 s when all pass
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(req=requests())
def test_fuzzed_requests_keep_the_invariants(stand, req: FuzzRequest) -> None:
    s, gw = stand
    ans = s.run(send(s.session, gw.url, req))
    assert not ans.problems, describe(req, ans)
    left = s.run(settled(s.session, gw.url, gw.engine_urls(), timeout_s=3))
    assert not left, f"left held: {left} after " + describe(req, ans)
    if ans.status == 200:
        assert not s.run(s.sink.wait_for([ans.trace_id], timeout_s=5)), "no span"
        t = s.sink.traces[ans.trace_id]
        assert t.overshoot == 0, (f"reserved {t.reserved} < input {t.input_tokens} + "
                                  f"output {t.output_tokens}: " + describe(req, ans))


def test_leftovers_see_an_open_request(stand) -> None:
    """The leak check can fail: while a stream is open it reports the engine lease
    and the engine's running request; once the stream ends, nothing."""
    s, gw = stand

    async def scenario() -> tuple[dict, dict, Any]:
        body = {"model": "sim-model", "max_tokens": 400, "stream": True,
                "messages": [{"role": "user", "content": "count slowly"}]}
        trace_id, tp = new_trace()
        async with s.session.post(gw.url + "/v1/chat/completions", json=body,
                                  headers={"Authorization": "Bearer harness-metered", **tp}) as r:
            assert r.status == 200
            await r.content.readany()
            during = await leftovers(s.session, gw.url, gw.engine_urls(), None)
            await r.read()
        after = await settled(s.session, gw.url, gw.engine_urls(), timeout_s=3)
        assert not await s.sink.wait_for([trace_id])
        return during, after, s.sink.traces[trace_id]

    during, after, traced = s.run(scenario())
    assert during.get("sluice_engine_requests_in_flight") == 1, during
    assert sum(v for k, v in during.items() if k.endswith("vllm:num_requests_running")) == 1
    assert after == {}
    assert traced.reserved is not None and traced.output_tokens == 400, traced
