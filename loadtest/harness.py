"""What the fuzz, fault and soak runs (``loadtest.fuzz``, ``loadtest.faults``,
``loadtest.soak``) share: a ``sluice serve`` stand with simulated engines, and the
invariants they check.

* :func:`write_config` — gateway.yaml / engines.yaml / tenants.yaml for the stand
  (``kind: sim`` engines the gateway launches, response cache off).
* :class:`TraceSink` — an OTLP/HTTP receiver for the gateway's spans. Each request
  is sent with its own W3C ``traceparent``, so its trace id names it; from its spans
  come the tokens the gateway reserved (``ratelimit.reserve`` span,
  ``sluice.reserved_tokens``) and the tokens it settled (server span,
  ``gen_ai.usage.input_tokens`` + ``gen_ai.usage.output_tokens``).
* :func:`leftovers` — what is still held once the gateway is idle (slots, leases,
  reservations, queue entries), read from ``/metrics``, the engines' ``/metrics``
  and the Redis counter store. Every series it reads is named in
  :data:`LEAK_SERIES` / :data:`ENGINE_LEAK_SERIES` / :data:`REDIS_LEASE_KEYS`.
* :func:`error_problem` / :func:`stream_end` — the shape of an answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import yaml
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client.parser import text_string_to_metric_families

from gateway.auth import hash_key
from loadtest.launch import free_port

MODEL = "sim-model"

#: Gateway gauges that must read 0 once no request is open. The first three exist
#: today; the others are the names expected from the leak-metrics work and are
#: counted as soon as the gateway exports them (absent series are skipped).
LEAK_SERIES = (
    "sluice_engine_requests_in_flight",    # engine leases (requests sent, not finished)
    "sluice_queue_depth",                  # admission-queue entries
    "sluice_queue_tokens",                 # tokens held by queued tickets
    "sluice_engine_promised_kv_blocks",    # KV blocks promised to in-flight requests
    "sluice_ratelimit_concurrency_slots_held",  # concurrency slots held by this gateway
    "sluice_ratelimit_reservations_open",     # token reservations not yet settled
    "sluice_limits_pending_releases",         # slot releases not yet in Redis
)
#: Engine gauges (vLLM names, also the simulator's) that must read 0 once the
#: gateway is idle: a request the gateway gave up on must have been aborted.
ENGINE_LEAK_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
#: Redis keys holding concurrency leases (``limits.rate_limit``: a sorted set per
#: tenant, ``{prefix}:{tenant}:concurrent``).
REDIS_LEASE_KEYS = "sluice:*:concurrent"

#: Env for the gateway process: export spans every 50 ms in batches of up to 4096 from
#: a queue of 200k (the SDK defaults, 5 s / 512 / 2048, would delay the per-request
#: checks and drop spans under fuzz load).
TRACE_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4096",
             "OTEL_BSP_MAX_QUEUE_SIZE": "200000"}


def api_key(tenant: str) -> str:
    return f"harness-{tenant}"


def tenant_entry(name: str, **quota: Any) -> dict[str, Any]:
    """A tenants.yaml entry whose key is :func:`api_key` ``(name)``."""
    return {"name": name, "api_key_hashes": [hash_key(api_key(name))], **quota}


def sim_engines(replicas: int, speed: float, *args: str) -> dict[str, Any]:
    """An engines.yaml entry: ``replicas`` simulator processes launched by the gateway."""
    return {"name": "sim", "model": MODEL, "kind": "sim", "replicas": replicas,
            "args": ["--profile", "cpu-gemma3-270m-quiet", "--speed", str(speed),
                     "--max-model-len", "4096", *args]}


def write_config(directory: Path, *, engines: dict[str, Any], tenants: list[dict[str, Any]],
                 gateway: dict[str, Any] | None = None,
                 saturation: dict[str, Any] | None = None,
                 supervisor: dict[str, Any] | None = None) -> Path:
    """Write the stand's three config files into ``directory`` (cache off: repeated
    bodies must reach the engines; access log off)."""
    directory.mkdir(parents=True, exist_ok=True)
    gw = {"cache": {"enabled": False}, "observability": {"access_log": False},
          **(gateway or {})}
    eng: dict[str, Any] = {"engines": [engines],
                           "supervisor": {"probe_interval_s": 0.5, "metrics_interval_s": 0.25,
                                          "restart_backoff_s": 0.2, "startup_grace_s": 60,
                                          "inference_probe_idle_s": 3600, **(supervisor or {})}}
    if saturation:
        eng["saturation"] = saturation
    (directory / "gateway.yaml").write_text(yaml.safe_dump(gw))
    (directory / "engines.yaml").write_text(yaml.safe_dump(eng))
    (directory / "tenants.yaml").write_text(yaml.safe_dump(
        {"allow_anonymous": True, "tenants": tenants}))
    return directory


# ----------------------------------------------------------------------------- traces


def new_trace() -> tuple[str, dict[str, str]]:
    """A fresh trace id (32 hex) and the ``traceparent`` header that starts it."""
    trace_id = secrets.token_hex(16)
    return trace_id, {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}


@dataclass
class Traced:
    """One request as the gateway's spans describe it; tokens.

    ``reserved`` is None when the request never reached the rate limiter (rejected
    before it)."""

    reserved: int | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    outcome: str | None = None
    status: int | None = None

    @property
    def overshoot(self) -> int:
        """Tokens settled beyond the reservation: ``input + output − reserved``, ≥ 0
        (what ``limits.rate_limit`` charges as debt on settle)."""
        if self.reserved is None:
            return 0
        return max(0, self.input_tokens + self.output_tokens - self.reserved)


def _attr(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


class TraceSink:
    """An OTLP/HTTP (protobuf) trace receiver on ``127.0.0.1``; ``url`` is the
    ``observability.otlp_endpoint`` to configure."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1/traces"
        self.traces: dict[str, Traced] = {}
        self._runner: web.AppRunner | None = None

    async def start(self) -> TraceSink:
        app = web.Application(client_max_size=256 * 2**20)
        app.router.add_post("/v1/traces", self._receive)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _receive(self, request: web.Request) -> web.Response:
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        for rs in msg.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    attrs = {a.key: _attr(a.value) for a in span.attributes}
                    t = self.traces.setdefault(span.trace_id.hex(), Traced())
                    if "sluice.reserved_tokens" in attrs:
                        t.reserved = (t.reserved or 0) + int(attrs["sluice.reserved_tokens"])
                    if "sluice.outcome" in attrs:  # the server span
                        t.outcome = attrs["sluice.outcome"]
                        t.status = int(attrs.get("http.response.status_code") or 0)
                        t.input_tokens = int(attrs.get("gen_ai.usage.input_tokens") or 0)
                        t.output_tokens = int(attrs.get("gen_ai.usage.output_tokens") or 0)
        return web.Response(status=200, content_type="application/x-protobuf")

    async def wait_for(self, trace_ids: Iterable[str], timeout_s: float = 10.0) -> list[str]:
        """Wait until every trace in ``trace_ids`` has its server span; returns those
        still missing at ``timeout_s``."""
        ids = list(trace_ids)
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [i for i in ids if (t := self.traces.get(i)) is None or t.outcome is None]
            if not missing or time.monotonic() > deadline:
                return missing
            await asyncio.sleep(0.05)


# ----------------------------------------------------------------------------- leaks


def gauge_sums(text: str, names: Iterable[str]) -> dict[str, float]:
    """``{name: sum over label sets}`` of the named series present in ``text``
    (Prometheus exposition)."""
    wanted = set(names)
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in wanted:
            out[family.name] = sum(s.value for s in family.samples if s.name == family.name)
    return out


async def leftovers(session: aiohttp.ClientSession, gateway_url: str,
                    engine_urls: Iterable[str] = (), redis_url: str | None = None
                    ) -> dict[str, float]:
    """Everything still held, ``{series: amount}`` with only non-zero entries: the
    gateway's :data:`LEAK_SERIES`, each engine's :data:`ENGINE_LEAK_SERIES`
    (``engine URL series``), and unexpired concurrency leases in Redis
    (``redis:KEY``). Empty means nothing leaked — when the gateway is idle."""
    out: dict[str, float] = {}
    async with session.get(gateway_url + "/metrics") as r:
        out.update(gauge_sums(await r.text(), LEAK_SERIES))
    for url in engine_urls:
        try:
            async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
                for name, v in gauge_sums(await r.text(), ENGINE_LEAK_SERIES).items():
                    out[f"{url} {name}"] = v
        except (aiohttp.ClientError, TimeoutError):
            pass  # an engine being restarted holds nothing
    if redis_url:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(redis_url)
        try:
            now = time.time()
            async for key in client.scan_iter(REDIS_LEASE_KEYS):
                n = await client.zcount(key, now, "+inf")
                out[f"redis:{key.decode()}"] = float(n)
        except (OSError, aioredis.RedisError):
            pass  # Redis down: the leases expire there
        finally:
            await client.aclose()
    return {k: v for k, v in out.items() if v}


async def settled(session: aiohttp.ClientSession, gateway_url: str,
                  engine_urls: Iterable[str] = (), redis_url: str | None = None,
                  timeout_s: float = 5.0) -> dict[str, float]:
    """:func:`leftovers`, polled until empty or ``timeout_s`` (releases run in the
    request's ``finally`` just after the last byte); returns the last reading."""
    urls = list(engine_urls)
    deadline = time.monotonic() + timeout_s
    while True:
        left = await leftovers(session, gateway_url, urls, redis_url)
        if not left or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.1)


# ----------------------------------------------------------------------------- answers

#: 503s that are load shedding, not a fault: the request was fine, the gateway busy.
SHED_CODES = {"overloaded", "queue_timeout"}


def error_problem(status: int, raw: bytes) -> str | None:
    """Why an error answer is not a well-formed OpenAI error (``{"error":
    {"message", "type", "param", "code"}}`` with a string message), or None."""
    try:
        body = json.loads(raw)
    except ValueError:
        return f"HTTP {status} body is not JSON: {raw[:200]!r}"
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return f"HTTP {status} body is not an OpenAI error: {raw[:300]!r}"
    if not isinstance(err["message"], str) or not err["message"]:
        return f"HTTP {status} error without a message: {raw[:300]!r}"
    return None


def is_server_error(status: int, raw: bytes) -> bool:
    """A 5xx that is not load shedding (503 ``overloaded``/``queue_timeout``)."""
    if status < 500:
        return False
    if status == 503:
        try:
            return json.loads(raw)["error"]["code"] not in SHED_CODES
        except (ValueError, KeyError, TypeError):
            return True
    return True


def stream_end(raw: bytes) -> str:
    """How an SSE body ended: ``done`` (``data: [DONE]``, no error event), ``error``
    (an error event and no ``[DONE]``) or ``cut`` (neither: truncated)."""
    events = [e for e in raw.replace(b"\r\n", b"\n").split(b"\n\n") if e.startswith(b"data: ")]
    error = any(e.startswith(b'data: {"error"') for e in events)
    done = bool(events) and events[-1].strip() == b"data: [DONE]"
    if error and not done:
        return "error"
    return "done" if done and not error else "cut"


def rss_mb(pid: int) -> float:
    """Resident set size of process ``pid``, MiB."""
    return psutil.Process(pid).memory_info().rss / 2**20


def trace_env() -> None:
    """Put :data:`TRACE_ENV` into this process's environment, which
    :func:`loadtest.launch.gateway` passes to ``sluice serve``."""
    os.environ.update(TRACE_ENV)
