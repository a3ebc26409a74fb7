"""Nothing a client sends becomes an id, a metric label, a span name, a trace
attribute or a log key unbounded (issue 39 items 14 and 15).

* ``x-request-id``: the gateway always makes its own id (echoed, sent upstream,
  logged); the client's is recorded beside it as ``client_request_id``, cut to 64
  characters of ``A-Za-z0-9._:-``.
* Unknown model names, unknown paths and odd methods: the metrics say ``unknown``,
  span names take the route table's values, the access log no client string.
* ``x-session-id``: the sticky-session table keys a fixed-size digest of tenant and id.
"""

from __future__ import annotations

import json
import logging
import re

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engines.sessions import session_key
from gateway.app import create_app
from gateway.auth import hash_key
from gateway.keys import SCHEDULER
from tests.integration.conftest import make_config, run_gateway
from tests.integration.test_gateway_api import CHAT

TENANTS = {"allow_anonymous": False, "tenants": [
    {"name": "acme", "api_key_hashes": [hash_key("k-acme")]},
    {"name": "beta", "api_key_hashes": [hash_key("k-beta")]}]}
ACME = {"Authorization": "Bearer k-acme"}
BETA = {"Authorization": "Bearer k-beta"}
HEX32 = re.compile(r"^[0-9a-f]{32}$")


def access_lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "sluice.access"]


async def test_the_request_id_is_the_gateways_and_the_clients_is_kept_bounded(engines, caplog):
    (fake,) = await engines(1)
    caplog.set_level(logging.INFO, logger="sluice.access")
    async with run_gateway(make_config([fake], tenants=TENANTS)) as gw:
        ids = []
        for headers in (ACME, BETA):  # two tenants reuse one id
            r = await gw.post("/v1/chat/completions", CHAT,
                              headers={**headers, "x-request-id": "req-123"})
            assert r.status == 200
            ids.append(r.headers["x-request-id"])
            assert HEX32.match(ids[-1]) and fake.headers[-1]["x-request-id"] == ids[-1]
        assert ids[0] != ids[1]
        long_and_odd = "x" * 70 + " <a href=/evil>\tü"
        r = await gw.post("/v1/chat/completions", CHAT,
                          headers={**ACME, "x-request-id": "ok.id:1/" + long_and_odd})
        assert HEX32.match(r.headers["x-request-id"])
        r = await gw.post("/v1/chat/completions", {**CHAT, "model": "nope"},
                          headers={**ACME, "x-request-id": "e" * 8000})
        assert r.status == 404 and HEX32.match(r.headers["x-request-id"])
    lines = access_lines(caplog)
    assert [line["request_id"] for line in lines[:2]] == ids
    assert [line["client_request_id"] for line in lines[:2]] == ["req-123", "req-123"]
    assert lines[2]["client_request_id"] == "ok.id:1_" + "x" * 56
    assert lines[3]["client_request_id"] == "e" * 64
    assert all(len(line["request_id"]) == 32 for line in lines)


async def test_client_strings_never_become_labels_span_names_or_log_values(engines, caplog):
    (fake,) = await engines(1)
    cfg = make_config([fake], tenants=TENANTS)
    exporter = InMemorySpanExporter()
    caplog.set_level(logging.INFO, logger="sluice.access")
    marker = "zq"  # in every client-chosen string below, in no configured name
    async with run_gateway(cfg, app=create_app(cfg, span_exporter=exporter)) as gw:
        for i in range(50):  # unknown models: 404 each, one label
            r = await gw.post("/v1/chat/completions",
                              {**CHAT, "model": f"{marker}-model-{i}" + "m" * 1000}, headers=ACME)
            assert r.status == 404
        for i in range(20):  # unknown paths and methods under /v1/
            r = await gw.post(f"/v1/{marker}-path-{i}/" + "p" * 2000, CHAT, headers=ACME)
            assert r.status == 404
        # aiohttp parses only the methods llhttp knows; one that no route takes
        async with gw.session.request("PROPFIND", gw.url + "/v1/chat/completions",
                                      headers=ACME) as r:
            assert r.status == 405
        r = await gw.post("/v1/chat/completions", CHAT, headers=ACME)
        assert r.status == 200
        metrics = await (await gw.session.get(gw.url + "/metrics")).text()
    assert marker not in metrics.lower()
    assert 'model="unknown"' in metrics
    spans = exporter.get_finished_spans()
    names = {s.name for s in spans}
    assert not any(marker in n.lower() for n in names), names
    assert names >= {"POST unmatched", "_OTHER unmatched", "POST /v1/chat/completions",
                     "chat fake-model"}
    for s in spans:
        for key, value in (s.attributes or {}).items():
            assert marker not in key.lower() and marker not in str(value).lower(), (key, value)
    lines = access_lines(caplog)
    assert len(lines) == 72
    for line in lines:
        assert marker not in json.dumps(line).lower(), line
    assert {line["path"] for line in lines} == {"/v1/chat/completions", "unmatched"}
    assert {line["model"] for line in lines} == {None, "fake-model"}


async def test_session_ids_are_keyed_by_a_digest_per_tenant(engines):
    fakes = await engines(2)
    async with run_gateway(make_config(fakes, tenants=TENANTS)) as gw:
        sessions = gw.app[SCHEDULER].sessions
        huge = "s" * 8000
        r = await gw.post("/v1/chat/completions", CHAT, headers={**ACME, "x-session-id": huge})
        first = r.headers["x-sluice-engine"]
        r = await gw.post("/v1/chat/completions", CHAT, headers={**BETA, "x-session-id": huge})
        assert r.status == 200
        second = r.headers["x-sluice-engine"]
        table = sessions._table
        assert len(table) == 2 and all(HEX32.match(k) for k in table)  # one per tenant
        assert table[session_key("acme", huge)][0] == first
        assert table[session_key("beta", huge)][0] == second

