"""A Responses chain through ``sluice serve --workers 2`` (two real gateway
processes on one port, cache store on a private Redis) in front of an ``external``
:class:`FakeEngine`: every turn is a new connection, the turns land on both workers,
and each follow-up reaches the engine as the whole conversation — the gateway, not the
engine, holds the state (the engine answers 404 to any ``previous_response_id``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import openai
import pytest

from tests.integration.fake_engine import FakeEngine
from tests.integration.limits_support import tenant, write_config
from tests.integration.test_workers import metrics_port_pair, workers

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    """A fake engine on its own event loop thread (the test itself blocks)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    fake = asyncio.run_coroutine_threadsafe(FakeEngine().start(), loop).result(10)
    yield fake
    asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_responses_chain_across_two_worker_processes(tmp_path, engine, redis_url) -> None:
    metrics_port = metrics_port_pair()
    gateway = {"cache": {"enabled": True, "store_url": redis_url,
                         "semantic": {"enabled": False}},
               "limits": {"store_url": redis_url, "redis_timeout_s": 5.0},
               "observability": {"access_log": False, "tracing": False,
                                 "metrics_listen": f"127.0.0.1:{metrics_port}"}}
    cfg = write_config(tmp_path, tenants=[tenant("acme")], gateway=gateway, engines=[
        {"name": "fake", "model": engine.model, "kind": "external", "url": engine.url}])
    with workers(cfg, metrics_port) as w:
        turn = None
        for i in range(10):  # new connections until both workers served a turn (and ≥ 3)
            client = openai.OpenAI(base_url=w.url + "/v1", api_key="key-acme", max_retries=0)
            raw = client.responses.with_raw_response.create(
                model=engine.model, input=f"turn {i}", max_output_tokens=1,
                **({"previous_response_id": turn.id} if turn else {}))
            turn = raw.parse()
            sent = engine.received[-1]
            assert "previous_response_id" not in sent
            # the whole conversation: every earlier input and output, then this input
            assert sent["input"] == "turn 0" if i == 0 else [
                m["content"] for m in sent["input"]] == [
                x for j in range(i) for x in (f"turn {j}", "Hello")] + [f"turn {i}"]
            per_worker = [_responses_served(u) for u in w.metrics_urls]
            if i >= 2 and min(per_worker) >= 1:
                break
        assert min(per_worker) >= 1, f"every turn landed on one worker: {per_worker}"
        # any worker returns any stored turn
        for _ in range(4):
            assert openai.OpenAI(base_url=w.url + "/v1", api_key="key-acme").responses \
                .retrieve(turn.id).output_text == "Hello"


def _responses_served(metrics_url: str) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url, timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "sluice_requests_total" and s.labels.get("endpoint") == "responses"
               and s.labels["status"] == "200")
