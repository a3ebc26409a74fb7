"""Exact and semantic response cache (docs/architecture.md, "One request", step 5).

The gateway uses :mod:`cache.service` (``open_cache``, ``ResponseCache``,
``CacheRequest``, ``CacheHit``) and :mod:`cache.replay` (render a hit as JSON or SSE).
Inside: :mod:`cache.keys` (what makes two requests the same), :mod:`cache.policy`
(what may be cached), :mod:`cache.stores` and :mod:`cache.exact` (response bodies),
:mod:`cache.embedder`, :mod:`cache.index`, :mod:`cache.guards` and
:mod:`cache.semantic` (the last user turn compared by meaning). Protocols live in
:mod:`cache.interfaces`. This package imports only :mod:`config`.
"""
