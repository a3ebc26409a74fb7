"""The response cache as the gateway sees it: :class:`ResponseCache`.

Per request the gateway builds a :class:`CacheRequest` (:meth:`ResponseCache.request`)
and calls :meth:`ResponseCache.lookup` before rate limiting (exact first, then
semantic), answers a hit with :func:`replay`, and hands the complete answer to
:meth:`ResponseCache.store_later` (or :meth:`ResponseCache.store`). Which requests and
responses qualify is :mod:`cache.policy`; keys are :mod:`cache.keys`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio as aioredis
from aiohttp import web

from cache.embedder import BatchingEmbedder
from cache.exact import ExactCache
from cache.interfaces import ByteStore
from cache.keys import CacheKey, EndpointKind, make_key
from cache.policy import (
    CACHED_ENDPOINTS,
    STREAM_LOSSY,
    cut_at_cap,
    request_cacheable,
    response_storable,
)
from cache.replay import as_json, as_sse_of
from cache.semantic import SemanticCache
from cache.stores import MemoryByteStore, RedisByteStore
from config.schema import CacheConfig, TenantCache
from limits.clock import MONOTONIC
from limits.interfaces import Clock

log = logging.getLogger(__name__)

#: Failures of the shared store that make the cache step aside (fail open).
STORE_ERRORS: tuple[type[BaseException], ...] = (aioredis.RedisError, OSError,
                                                  asyncio.TimeoutError)


def cache_control(header: str) -> tuple[bool, bool]:
    """(no_cache, no_store) from a ``Cache-Control`` header's value."""
    tokens = {t.strip().lower() for t in header.split(",")}
    return "no-cache" in tokens, "no-store" in tokens


@dataclass(frozen=True)
class CacheRequest:
    """One request as the cache needs it.

    Attributes:
        namespace: the tenant's cache namespace (``TenantQuota.namespace``).
        tenant: the tenant's cache settings (``TenantQuota.cache``).
        endpoint: one of :data:`cache.keys.EndpointKind`.
        model: the model that answers.
        body: the JSON body as looked up (the client's, with the tenant's output cap
            and ``cache_salt``); never modified. :meth:`ResponseCache.store` gets the
            same request, so lookup and store compute one key.
        no_cache: ``Cache-Control: no-cache`` — skip the lookup.
        no_store: ``Cache-Control: no-store`` — do not keep the answer.
        large: the body is large (``gateway.offload_bytes``): its key is computed in
            a worker thread, off the event loop.
    """

    namespace: str
    tenant: TenantCache
    endpoint: EndpointKind
    model: str
    body: dict[str, Any]
    no_cache: bool = False
    no_store: bool = False
    large: bool = False


@dataclass(frozen=True)
class CacheHit:
    """A cached answer: ``kind`` is ``exact`` or ``semantic``; ``response`` the stored
    non-streaming body (render it with :mod:`cache.replay`)."""

    kind: Literal["exact", "semantic"]
    response: dict[str, Any]


class ResponseCache:
    """Exact + semantic response cache.

    Args:
        cfg: ``GatewayConfig.cache``.
        exact: the exact cache (its store decides memory vs Redis).
        semantic: the semantic cache, or None when ``cfg.semantic.enabled`` is false.
    """

    def __init__(self, cfg: CacheConfig, exact: ExactCache,
                 semantic: SemanticCache | None) -> None:
        self.cfg = cfg
        self.exact = exact
        self.semantic = semantic
        self._background: set[asyncio.Task[object]] = set()

    def request(self, *, namespace: str, tenant: TenantCache, endpoint: EndpointKind,
                model: str, body: dict[str, Any], cache_control_header: str,
                large: bool = False) -> CacheRequest | None:
        """The cache's view of one request (``body`` is copied), or None when the
        cache is off or the endpoint is not one it serves (:data:`CACHED_ENDPOINTS`);
        ``cache_control_header``: the request's ``Cache-Control``; ``large``: key it
        off the event loop (:attr:`CacheRequest.large`)."""
        if not self.cfg.enabled or endpoint not in CACHED_ENDPOINTS:
            return None
        no_cache, no_store = cache_control(cache_control_header)
        return CacheRequest(namespace=namespace, tenant=tenant, endpoint=endpoint,
                            model=model, body=dict(body), no_cache=no_cache,
                            no_store=no_store, large=large)

    def store_later(self, creq: CacheRequest, answer: dict[str, Any], *, model: str,
                    cap_written: bool, streamed: bool = False) -> None:
        """Store a finished answer off the response path (the semantic cache embeds
        the question, ~20 ms on CPU), under the very request it was looked up with
        (``creq``: the body before the gateway's own edits, so lookup and store
        compute one key). Not stored: a fallback model's answer (``model``, the model
        that answered, is not ``creq.model``), and an answer cut (``length``) at an
        output cap the gateway wrote after the lookup (``cap_written``: the
        tokens/min cap, a degradation rung): the request as looked up did not ask for
        that cut. An answer that stopped by itself is the same under any larger cap,
        so it is stored. A ``streamed`` answer reassembled from its events is not
        stored when the request asked for fields the reassembly drops
        (:data:`cache.policy.STREAM_LOSSY`)."""
        if streamed and STREAM_LOSSY.intersection(creq.body):
            return
        if creq.no_store or not request_cacheable(creq.body, creq.tenant, creq.endpoint):
            return  # what store would decide, without a task per request
        if model != creq.model:
            return
        if cap_written and cut_at_cap(answer):
            return
        task = asyncio.create_task(self.store(creq, answer))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def eligible(self, req: CacheRequest) -> bool:
        """Whether the cache is consulted at all (else the response says ``bypass``)."""
        return self.cfg.enabled and not req.no_cache and request_cacheable(
            req.body, req.tenant, req.endpoint)

    async def lookup(self, req: CacheRequest) -> CacheHit | None:
        """The cached answer to ``req``, or None (miss, or not :meth:`eligible`). A
        store failure (Redis down or slow) is logged and answers None: the cache fails
        open, it never fails the request."""
        if not self.eligible(req):
            return None
        try:
            return await self._lookup(req)
        except STORE_ERRORS as exc:
            log.warning("cache lookup failed, treated as a miss: %r", exc)
            return None

    @staticmethod
    async def _key(req: CacheRequest) -> CacheKey:
        """:func:`make_key` (a hash of the whole body), in a worker thread for a
        large body."""
        args = (req.namespace, req.endpoint, req.model, req.body)
        return await asyncio.to_thread(make_key, *args) if req.large else make_key(*args)

    async def _lookup(self, req: CacheRequest) -> CacheHit | None:
        key = await self._key(req)
        response = await self.exact.get(key.exact)
        if response is not None:
            return CacheHit("exact", response)
        if self.semantic is None or key.scope is None or key.query is None:
            return None
        threshold = req.tenant.semantic_threshold
        if threshold is None:
            threshold = self.cfg.semantic.threshold
        match = await self.semantic.lookup(key.scope, key.query, threshold)
        if match is None:
            return None
        response = await self.exact.get(match.exact)
        return None if response is None else CacheHit("semantic", response)

    async def store(self, req: CacheRequest, response: dict[str, Any]) -> bool:
        """Keep ``response`` (the complete non-streaming body) for ``req`` if the
        policy allows; returns whether it was stored (False also when the store
        failed; logged)."""
        if not (self.cfg.enabled and not req.no_store
                and request_cacheable(req.body, req.tenant, req.endpoint) and response_storable(response)):
            return False
        try:
            await self._store(req, response)
        except STORE_ERRORS as exc:
            log.warning("cache store failed, answer not cached: %r", exc)
            return False
        return True

    async def _store(self, req: CacheRequest, response: dict[str, Any]) -> None:
        key = await self._key(req)
        ttl_s = req.tenant.ttl_s or self.cfg.default_ttl_s
        await self.exact.put(key.exact, response, ttl_s)
        if self.semantic is not None and key.scope is not None and key.query is not None:
            await self.semantic.add(key.scope, key.query, key.exact, ttl_s)

    async def close(self) -> None:
        """Close the semantic index thread, the embedder and the store; idempotent."""
        if self.semantic is not None:
            await self.semantic.close()
            await self.semantic.embedder.close()
        await self.exact.store.close()


async def replay(request: web.Request, hit: CacheHit, endpoint: EndpointKind, model: str, *,
                 stream: bool, include_usage: bool, headers: dict[str, str],
                 sse_headers: dict[str, str],
                 on_answer: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
                 ) -> web.StreamResponse:
    """Answer ``request`` with a cached answer (:mod:`cache.replay`): a JSON body, or
    for ``stream`` the SSE events (with ``sse_headers`` too), with ``headers``.
    ``on_answer`` gets the rendered answer (its fresh id) before it is sent: a replayed
    Response is stored for ``previous_response_id`` like one the engine made."""
    body = as_json(hit.response, endpoint, model)
    if on_answer is not None:
        await on_answer(body)
    if not stream:
        return web.json_response(body, headers=headers)
    out = web.StreamResponse(headers={**sse_headers, **headers})
    await out.prepare(request)
    await out.write(b"".join(as_sse_of(body, endpoint, include_usage=include_usage)))
    await out.write_eof()
    return out


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
#: Connect and per-command timeout for the cache's Redis, s: a slow cache is a miss.
REDIS_TIMEOUT_S = 0.5


def open_byte_store(cfg: CacheConfig,
                    clock: Clock = MONOTONIC) -> tuple[ByteStore, aioredis.Redis | None]:
    """The byte store of ``cfg.store_url`` and its Redis client (None for
    ``memory://``, an LRU capped at ``cfg.max_bytes`` whose entries expire by
    ``clock``).

    Raises:
        ValueError: ``store_url`` is neither ``memory://`` nor Redis.
    """
    if cfg.store_url.startswith("memory://"):
        return MemoryByteStore(cfg.max_bytes, clock), None
    if cfg.store_url.startswith(REDIS_SCHEMES):
        redis = aioredis.Redis.from_url(cfg.store_url, socket_timeout=REDIS_TIMEOUT_S,
                                        socket_connect_timeout=REDIS_TIMEOUT_S)
        return RedisByteStore(redis), redis
    raise ValueError(f"cache.store_url must be memory:// or redis://, got {cfg.store_url!r}")


def open_cache(cfg: CacheConfig, embedder: BatchingEmbedder | None = None,
               clock: Clock = MONOTONIC) -> ResponseCache:
    """Build the :class:`ResponseCache` for ``cfg.store_url``: ``memory://`` (one
    process, LRU capped at ``cfg.max_bytes``) or ``redis://…`` (shared; the semantic
    entries go through the same connection). ``embedder`` defaults to
    :class:`~cache.embedder.MiniLMEmbedder` behind a
    :class:`~cache.embedder.BatchingEmbedder` (loads the model, ~1 s). ``clock`` (s)
    expires ``memory://`` entries and times the semantic lookups."""
    store, redis = open_byte_store(cfg, clock)
    semantic = None
    if cfg.semantic.enabled:
        if embedder is None:
            from cache.embedder import MiniLMEmbedder

            embedder = BatchingEmbedder(MiniLMEmbedder(), clock=clock)
        semantic = SemanticCache(embedder, cfg.semantic, redis, clock=clock)
    return ResponseCache(cfg, ExactCache(store, cfg.default_ttl_s), semantic)
