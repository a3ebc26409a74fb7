"""Prometheus metrics, OpenTelemetry spans, access log lines and the stats feed, after
requests of every outcome (success, 401, 429, 503, cache hit, shed)."""

from __future__ import annotations

import asyncio
import json
import logging

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.auth import hash_key
from gateway.keys import QUEUES
from tests.conftest import free_port
from tests.integration.conftest import make_config, run_gateway
from tests.integration.test_gateway_api import CHAT
from tests.support import wait_for

TENANTS = {
    "allow_anonymous": False,
    "tenants": [
        {"name": "acme", "api_key_hashes": [hash_key("k-acme")], "requests_per_min": 3},
        {"name": "batchco", "api_key_hashes": [hash_key("k-batch")], "priority": "batch",
         "max_queue_wait_s": 0.5},
    ],
}
ACME = {"Authorization": "Bearer k-acme"}
BATCH = {"Authorization": "Bearer k-batch"}


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(m: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in m.items()
               if n == name and all((k, v2) in lab for k, v2 in labels.items()))


async def scrape(gw) -> dict:
    return samples(await (await gw.session.get(gw.url + "/metrics")).text())


async def test_metrics_traces_and_access_log_for_every_outcome(engines, caplog):
    (fake,) = await engines(1)
    cfg = make_config([fake], tenants=TENANTS, models=["ghost-model"],
                      gateway={"queue": {"max_requests": 1}})
    exporter = InMemorySpanExporter()
    caplog.set_level(logging.INFO, logger="sluice.access")
    async with run_gateway(cfg, ready=1, app=create_app(cfg, span_exporter=exporter)) as gw:
        before = await scrape(gw)
        assert value(before, "sluice_engine_up", engine="e0", state="ready") == 1
        assert value(before, "sluice_engine_kv_cache_usage_ratio", engine="e0") == 0.1
        # success (a cacheable one), then a cache hit
        det = {**CHAT, "temperature": 0}
        r = await gw.post("/v1/chat/completions", det, headers=ACME)
        assert r.status == 200 and r.headers["x-sluice-cache"] == "miss"
        await gw.idle()  # the answer is stored off the response path
        r = await gw.post("/v1/chat/completions", det, headers=ACME)
        assert r.status == 200 and r.headers["x-sluice-cache"] == "hit-exact"
        # 401 and 429 (acme allows 3 requests per minute)
        assert (await gw.post("/v1/chat/completions", CHAT)).status == 401
        assert (await gw.post("/v1/chat/completions", CHAT, headers=ACME)).status == 200
        r = await gw.post("/v1/chat/completions", CHAT, headers=ACME)
        assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
        # 503: no engine for the model
        r = await gw.post("/v1/chat/completions", {**CHAT, "model": "ghost-model"}, headers=BATCH)
        assert r.status == 503
        # shed: the engine is full (KV over the watermark), one batch request waits; the
        # next one is shed at once (the predicted wait exceeds batchco's 0.5 s)
        fake.kv_usage = 0.99
        engine, queue = gw.pool.engines[0], gw.app[QUEUES][fake.model]
        await wait_for(lambda: engine.metrics.kv_cache_usage == 0.99, what="the next scrape")
        first = asyncio.create_task(gw.post("/v1/chat/completions", CHAT, headers=BATCH))
        await wait_for(lambda: len(queue) == 1, what="the first batch request to queue")
        r = await gw.post("/v1/chat/completions", CHAT, headers=BATCH)
        assert r.status == 503 and (await r.json())["error"]["code"] == "overloaded"
        r = await first
        assert r.status == 503 and (await r.json())["error"]["code"] == "queue_timeout"
        after = await scrape(gw)
        stats = await (await gw.session.get(gw.url + "/admin/stats")).json()

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("sluice_requests_total", tenant="acme", outcome="ok", status="200") == 2
    assert moved("sluice_requests_total", tenant="acme", outcome="cache_hit") == 1
    assert moved("sluice_requests_total", tenant="unknown", outcome="unauthorized",
                 status="401") == 1
    assert moved("sluice_requests_total", tenant="acme", outcome="rate_limited",
                 status="429") == 1
    assert moved("sluice_rejected_total", tenant="acme",
                 reason="rate_limited:requests_per_min") == 1
    assert moved("sluice_rejected_total", tenant="batchco", reason="no_engine") == 1
    assert moved("sluice_rejected_total", tenant="batchco", reason="overloaded:shed") == 1
    assert moved("sluice_rejected_total", tenant="batchco", reason="queue_timeout") == 1
    assert moved("sluice_cache_lookups_total", kind="exact", result="hit") == 1
    assert moved("sluice_cache_lookups_total", kind="exact", result="miss") == 1
    n_words = len(fake.reply.split(" "))
    # two engine answers; the exact hit replays usage on its own series
    assert moved("sluice_tokens_total", tenant="acme", kind="completion") == 2 * n_words
    assert moved("sluice_tokens_total", tenant="acme", kind="prompt") == 2 * 7
    assert moved("sluice_cached_tokens_total", tenant="acme", kind="completion") == n_words
    assert moved("sluice_cached_tokens_total", tenant="acme", kind="prompt") == 7
    assert value(after, "sluice_ratelimit_reservations_open") == 0
    assert value(after, "sluice_ratelimit_concurrency_slots_held") == 0
    assert value(after, "sluice_engine_promised_kv_blocks", engine="e0") == 0
    assert value(after, "sluice_output_overshoot_tokens_total", tenant="acme") == 0
    assert moved("sluice_ttft_seconds_count", model="fake-model", engine="e0") == 2
    assert moved("sluice_queue_wait_seconds_count", priority="batch") == 1
    assert value(after, "sluice_queue_depth", model="fake-model", priority="batch") == 0
    assert value(after, "sluice_engine_kv_cache_usage_ratio", engine="e0") == 0.99
    # no request ids or prompts in labels
    assert not any("Hi" in v or len(v) == 32 for (_, lab) in after for _, v in lab)

    # the stats feed agrees with the counters
    assert stats["tenants"]["acme"]["admitted"] == 3
    assert stats["tenants"]["batchco"]["rejected"]["overloaded:shed"] == 1
    assert stats["cache"] == {"lookups": 2, "hits": 1, "hit_rate": 0.5}
    assert stats["engines"][0]["id"] == "e0"

    # traces: the served request has every child span and GenAI attributes
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "chat fake-model"]
    ok_root = next(s for s in roots if s.attributes["sluice.outcome"] == "ok")
    children = {s.name: s for s in spans if s.parent and s.parent.span_id ==
                ok_root.context.span_id}
    assert {"cache.lookup", "ratelimit.reserve", "queue.wait", "schedule",
            "upstream"} <= set(children)
    assert ok_root.attributes["gen_ai.request.model"] == "fake-model"
    assert ok_root.attributes["gen_ai.usage.output_tokens"] == n_words
    assert ok_root.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert children["schedule"].attributes["sluice.engine"] == "e0"
    # the engine received the upstream span's trace context
    upstream = children["upstream"]
    sent = fake.headers[0]["traceparent"]
    assert sent.split("-")[1] == format(upstream.context.trace_id, "032x")
    assert sent.split("-")[2] == format(upstream.context.span_id, "016x")

    # one access-log line per request, with the outcome
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "sluice.access"]
    outcomes = [ln["outcome"] for ln in lines]
    for expected in ("ok", "cache_hit", "unauthorized", "rate_limited", "no_engine",
                     "overloaded", "queue_timeout"):
        assert expected in outcomes
    hit = next(ln for ln in lines if ln["outcome"] == "cache_hit")
    assert hit["tenant"] == "acme" and hit["cache"] == "hit-exact" and hit["status"] == 200
    assert all("Hi" not in json.dumps(ln) for ln in lines)  # no prompt text


async def test_stream_span_has_first_token_event(engines):
    (fake,) = await engines(1)
    cfg = make_config([fake])
    exporter = InMemorySpanExporter()
    async with run_gateway(cfg, app=create_app(cfg, span_exporter=exporter)) as gw:
        r = await gw.post("/v1/chat/completions", {**CHAT, "stream": True})
        await r.read()
    upstream = next(s for s in exporter.get_finished_spans() if s.name == "upstream")
    assert [e.name for e in upstream.events] == ["first_token"]


async def test_admin_stats_needs_admin_key_when_configured(engines):
    (fake,) = await engines(1)
    cfg = make_config([fake], gateway={"admin_key_hashes": [hash_key("adm")]})
    async with run_gateway(cfg) as gw:
        r = await gw.session.get(gw.url + "/admin/stats")
        assert r.status == 401
        r = await gw.session.get(gw.url + "/admin/stats", headers={"Authorization": "Bearer no"})
        assert r.status == 401
        r = await gw.session.get(gw.url + "/admin/stats", headers={"x-api-key": "adm"})
        assert r.status == 200 and "series" in await r.json()


async def test_metrics_on_a_separate_listen_address(engines):
    (fake,) = await engines(1)
    port = free_port()
    cfg = make_config([fake], gateway={"observability": {"metrics_listen": f"127.0.0.1:{port}"}})
    async with run_gateway(cfg) as gw:
        assert (await gw.post("/v1/chat/completions", CHAT)).status == 200
        r = await gw.session.get(f"http://127.0.0.1:{port}/metrics")
        assert value(samples(await r.text()), "sluice_requests_total", outcome="ok") == 1
        assert (await gw.session.get(gw.url + "/metrics")).status == 404
