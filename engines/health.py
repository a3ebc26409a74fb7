"""Probes of an engine's health and the pure rules the supervisor applies to them.

I/O: :func:`probe_ready` (``GET /health`` then ``GET /v1/models``) and
:func:`probe_inference` (a 1-token completion). Pure: :func:`made_progress` (is a
busy engine that misses probes still working?) and :func:`backoff_delay`.
"""

from __future__ import annotations

import logging

import aiohttp

from engines.pool import MetricsSnapshot

log = logging.getLogger(__name__)

_ERRORS = (aiohttp.ClientError, TimeoutError, ValueError)


async def probe_ready(
    session: aiohttp.ClientSession, base_url: str, model: str, timeout_s: float,
    health_path: str = "/health",
) -> bool:
    """True if ``GET <health_path>`` answers 200 and ``GET /v1/models`` lists ``model``
    (vLLM answers /health before the model is served on some versions), each within
    ``timeout_s`` seconds. A 404 from the health path, or an empty ``health_path``,
    leaves the decision to ``/v1/models`` (an OpenAI-compatible server need not have
    ``/health``). Never raises for network or protocol errors."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        if health_path:
            async with session.get(f"{base_url}{health_path}", timeout=timeout) as resp:
                if resp.status not in (200, 404):
                    return False
        async with session.get(f"{base_url}/v1/models", timeout=timeout) as resp:
            if resp.status != 200:
                return False
            body = await resp.json(content_type=None)
        return any(m.get("id") == model for m in body.get("data", []))
    except (*_ERRORS, AttributeError, TypeError) as e:
        log.debug("probe %s: %r", base_url, e)
        return False


#: The 1-token request of the inference probe, per endpoint.
_PROBES = {
    "completions": ("/v1/completions", {"prompt": "Hi"}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    "embeddings": ("/v1/embeddings", {"input": "Hi"}),
}


async def probe_inference(
    session: aiohttp.ClientSession, base_url: str, model: str, timeout_s: float,
    endpoint: str = "completions",
) -> bool:
    """True if a 1-token request (``max_tokens: 1``) to ``endpoint`` (``completions``
    or ``chat``) answers 200 with a choice, or for ``embeddings`` (a pooling engine)
    a one-word input answers 200 with a vector, within ``timeout_s`` seconds: the model
    itself runs, not just the HTTP server. A 404 or 405 from completions (a chat-only
    server) is followed by the same probe on chat completions. Never raises for
    network or protocol errors."""
    path, fields = _PROBES[endpoint]
    body = {"model": model, **fields} if endpoint == "embeddings" else {
        "model": model, "max_tokens": 1, "temperature": 0, **fields}
    try:
        async with session.post(
            f"{base_url}{path}", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            if resp.status in (404, 405) and endpoint == "completions":
                return await probe_inference(session, base_url, model, timeout_s, "chat")
            if resp.status != 200:
                return False
            data = await resp.json(content_type=None)
        return bool(data.get("data" if endpoint == "embeddings" else "choices"))
    except (*_ERRORS, AttributeError) as e:
        log.debug("inference probe %s: %r", base_url, e)
        return False


def made_progress(
    before: MetricsSnapshot | None, after: MetricsSnapshot | None, now: float, stale_s: float
) -> bool:
    """Whether an engine that failed a probe is nonetheless working: its latest
    metrics are fresh (scraped at most ``stale_s`` seconds before ``now``) and its
    counters moved since ``before`` (the snapshot seen at the previous probe):
    tokens generated, prompts admitted, or the waiting queue changed. Answering
    ``/metrics`` shows the server is up; moving counters show the model is busy, not
    hung (requests merely counted as running may be stuck)."""
    if after is None or now - after.at > stale_s:
        return False
    return before is not None and after.at > before.at and (
        after.generation_tokens != before.generation_tokens
        or after.prefix_cache_queries != before.prefix_cache_queries
        or after.num_waiting != before.num_waiting
    )


def backoff_delay(attempt: int, base_s: float, max_s: float) -> float:
    """Delay before restart number ``attempt`` (1 = first) of a failing engine, s:
    exponential backoff ``base_s · 2^(attempt-1)`` capped at ``max_s``."""
    return min(max_s, base_s * 2 ** max(0, attempt - 1))
