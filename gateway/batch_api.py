"""The OpenAI Batch API's endpoints (https://platform.openai.com/docs/api-reference/batch,
``…/files``), as the ``openai`` SDK's ``files`` and ``batches`` call them:

* ``POST /v1/files`` (multipart: ``file``, ``purpose=batch``; at most
  ``batch.max_file_bytes`` and ``batch.max_lines``, validated line by line, 400 naming
  the lines), ``GET /v1/files`` (``limit``, ``after``, ``purpose``),
  ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``;
* ``POST /v1/batches`` (``input_file_id``, ``endpoint`` — one of OpenAI's batch
  endpoints that this gateway serves: chat completions and completions today,
  embeddings and responses once routed —, ``completion_window`` —
  ``24h`` or any ``N`` + ``s``/``m``/``h``/``d`` up to
  ``batch.max_completion_window_s`` —, ``metadata``), ``GET /v1/batches`` (newest
  first; ``limit`` 1–100, default 20; ``after``), ``GET /v1/batches/{id}``,
  ``POST /v1/batches/{id}/cancel``;
* operators (admin key): ``GET /admin/batches``, ``GET /admin/batches/{id}``,
  ``POST /admin/batches/{id}/cancel`` (every tenant's; ``sluice batches``).

A tenant sees only its own files and batches: another tenant's id answers 404 as an
unknown one. The lines run in :mod:`gateway.batch_runner`; the state is in
:mod:`batch.store`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from batch import jsonl
from batch.db import STORE_ERRORS
from batch.store import BatchRecord, JobStore, open_job_store
from config.schema import BatchConfig
from gateway.admin import require_admin
from gateway.batch_runner import BatchCollector, BatchRunner
from gateway.keys import (
    CONFIG,
    DIRECTOR,
    METRICS,
    POOL,
    QUEUES,
    RUNNER,
    SESSION,
    SLO_GATE,
    TENANT,
)
from limits.outcome import Outcome, Rejected

log = logging.getLogger("sluice.batch")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: Retry-After while the job store is unreachable, s; and how often it is retried.
STORE_RETRY_S = 5

_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
#: OpenAI's metadata bounds: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA = (16, 64, 512)


class _CreateBatch(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def _invalid(message: str, param: str | None = None) -> Rejected:
    return Rejected(Outcome.INVALID_REQUEST, message, param=param)


def _not_found(kind: str, ident: str) -> Rejected:
    return Rejected(Outcome.NOT_FOUND, f"No {kind} with id '{ident}'.", param="id")


def _cfg(request: web.Request) -> BatchConfig:
    return request.app[CONFIG].gateway.batch


def _unavailable() -> Rejected:
    return Rejected(Outcome.OVERLOADED, "The batch store is unavailable; retry shortly.",
                    retry_after_s=STORE_RETRY_S, reason="store_unavailable")


def _store(request: web.Request) -> JobStore:
    """Raises:
        Rejected: 503 while the job store has not opened."""
    store = request.app[RUNNER].store
    if store is None:
        raise _unavailable()
    return store


def _guarded(handler: Handler) -> Handler:
    """``handler`` with the job store's failures answered 503 (logged), not 500."""
    @functools.wraps(handler)
    async def run(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except STORE_ERRORS as e:
            log.warning("batch store failed: %r", e)
            raise _unavailable() from None
    return run


def _tenant(request: web.Request) -> str:
    return request[TENANT].name


def window_s(value: str, limit_s: float) -> float:
    """Seconds of a ``completion_window`` (``24h``, ``90m``…).

    Raises:
        Rejected: 400 when malformed or longer than ``limit_s``.
    """
    m = _WINDOW.match(value)
    seconds = int(m.group(1)) * _UNIT_S[m.group(2)] if m else -1
    if not 0 < seconds <= limit_s:
        raise _invalid(f"completion_window must be like '24h' (a whole number of s, m, h "
                       f"or d) and at most {limit_s:g} s; got {value!r}.", "completion_window")
    return float(seconds)


def _limit(request: web.Request, default: int = 20) -> int:
    raw = request.query.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= 100:
        raise _invalid("limit must be a whole number from 1 to 100.", "limit")
    return int(raw)


def _page(items: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    shown = items[:limit]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(items) > limit}


# --------------------------------------------------------------------------- files


async def _read_upload(request: web.Request, max_bytes: int) -> tuple[str | None, str, bytes]:
    """(purpose, filename, body) of a multipart upload, the body read up to
    ``max_bytes``.

    Raises:
        Rejected: 400 not multipart or no ``file``; 413 over ``max_bytes``.
    """
    try:
        reader = await request.multipart()
    except (AssertionError, ValueError, KeyError):
        raise _invalid("Upload a file as multipart/form-data with fields 'file' and "
                       "'purpose'.") from None
    purpose, filename, data = None, "", None
    while (part := await reader.next()) is not None:
        if not isinstance(part, aiohttp.BodyPartReader):
            continue
        if part.name == "purpose":
            raw = b""
            while chunk := await part.read_chunk(1024):
                raw += chunk
                if len(raw) > 1024:
                    raise _invalid("purpose is longer than 1 KiB.", "purpose")
            purpose = raw[:64].decode(errors="replace")
        elif part.name == "file":
            filename = (part.filename or "upload.jsonl")[:255]
            chunks, size = [], 0
            while chunk := await part.read_chunk(256 * 1024):
                size += len(chunk)
                if size > max_bytes:
                    raise Rejected(Outcome.BODY_TOO_LARGE, f"The file is larger than the "
                                   f"limit of {max_bytes} bytes.", param="file")
                chunks.append(chunk)
            data = b"".join(chunks)
        else:
            await part.release()
    if data is None:
        raise _invalid("The multipart body has no 'file' field.", "file")
    return purpose, filename, data


async def create_file(request: web.Request) -> web.Response:
    cfg = _cfg(request)
    purpose, filename, data = await _read_upload(request, cfg.max_file_bytes)
    if purpose != "batch":
        raise _invalid(f"purpose must be 'batch' (the only purpose this server stores); "
                       f"got {purpose!r}.", "purpose")
    try:
        lines = await asyncio.to_thread(jsonl.parse, data, max_lines=cfg.max_lines,
                                        max_line_bytes=cfg.max_line_bytes)
    except jsonl.InvalidFile as e:
        raise _invalid(f"Invalid batch file: {e}", "file") from None
    rec = await _store(request).add_file(_tenant(request), purpose, filename, data, len(lines))
    return web.json_response(rec.to_openai())


async def list_files(request: web.Request) -> web.Response:
    limit = _limit(request, 100)
    files = await _store(request).list_files(_tenant(request), limit + 1,
                                             request.query.get("after"),
                                             request.query.get("purpose"))
    return web.json_response(_page([f.to_openai() for f in files], limit))


async def get_file(request: web.Request) -> web.Response:
    fid = request.match_info["file_id"]
    rec = await _store(request).get_file(_tenant(request), fid)
    if rec is None:
        raise _not_found("file", fid)
    return web.json_response(rec.to_openai())


async def file_content(request: web.Request) -> web.Response:
    fid = request.match_info["file_id"]
    store = _store(request)
    rec = await store.get_file(_tenant(request), fid)
    data = None if rec is None else await store.file_content(fid)
    if data is None:
        raise _not_found("file", fid)
    return web.Response(body=data, content_type="application/octet-stream")


async def delete_file(request: web.Request) -> web.Response:
    fid = request.match_info["file_id"]
    if not await _store(request).delete_file(_tenant(request), fid):
        raise _not_found("file", fid)
    return web.json_response({"id": fid, "object": "file", "deleted": True})


# --------------------------------------------------------------------------- batches


def _metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    pairs, key_len, value_len = MAX_METADATA
    if value is not None and (len(value) > pairs or any(
            len(k) > key_len or len(v) > value_len for k, v in value.items())):
        raise _invalid(f"metadata holds at most {pairs} pairs, keys up to {key_len} "
                       f"characters and values up to {value_len}.", "metadata")
    return value


def _served(app: web.Application) -> list[str]:
    """The batch endpoints (:data:`batch.jsonl.ENDPOINTS`) with a POST route here."""
    posts = {r.resource.canonical for r in app.router.routes()
             if r.method == "POST" and r.resource is not None}
    return [e for e in jsonl.ENDPOINTS if e in posts]


async def create_batch(request: web.Request) -> web.Response:
    cfg, store, tenant = _cfg(request), _store(request), _tenant(request)
    try:
        body = _CreateBatch.model_validate_json(await request.read())
    except ValidationError as e:
        first = e.errors()[0]
        raise _invalid(f"{'.'.join(map(str, first['loc'])) or 'body'}: {first['msg']}",
                       ".".join(map(str, first["loc"])) or None) from None
    served = _served(request.app)
    if body.endpoint not in served:
        raise _invalid(f"endpoint must be one of {', '.join(served)} (the batch "
                       "endpoints this gateway serves).", "endpoint")
    seconds = window_s(body.completion_window, cfg.max_completion_window_s)
    metadata = _metadata(body.metadata)
    rec = await store.get_file(tenant, body.input_file_id)
    data = None if rec is None or rec.purpose != "batch" else \
        await store.file_content(body.input_file_id)
    if data is None:
        raise _not_found("batch input file", body.input_file_id)
    lines = await asyncio.to_thread(jsonl.parse, data, max_lines=cfg.max_lines,
                                    max_line_bytes=cfg.max_line_bytes)
    errors = [{"code": "mismatched_endpoint", "line": n, "param": "url",
               "message": f"The line's url {line.url!r} is not the batch's endpoint "
                          f"{body.endpoint!r}."}
              for n, line in enumerate(lines, start=1) if line.url != body.endpoint][:20]
    batch = await store.create_batch(tenant, body.endpoint, body.input_file_id,
                                     body.completion_window, seconds, metadata, lines,
                                     errors or None)
    if RUNNER in request.app:
        request.app[RUNNER].poke()
    return web.json_response(batch.to_openai())


async def _found(request: web.Request, batch: BatchRecord | None) -> web.Response:
    if batch is None:
        raise _not_found("batch", request.match_info["batch_id"])
    return web.json_response(batch.to_openai())


async def get_batch(request: web.Request) -> web.Response:
    return await _found(request, await _store(request).get_batch(
        _tenant(request), request.match_info["batch_id"]))


async def cancel_batch(request: web.Request) -> web.Response:
    return await _found(request, await _store(request).cancel_batch(
        _tenant(request), request.match_info["batch_id"]))


async def list_batches(request: web.Request) -> web.Response:
    limit = _limit(request)
    batches = await _store(request).list_batches(_tenant(request), limit + 1,
                                                 request.query.get("after"))
    return web.json_response(_page([b.to_openai() for b in batches], limit))


# --------------------------------------------------------------------------- operators


async def admin_list(request: web.Request) -> web.Response:
    require_admin(request)
    limit = _limit(request)
    batches = await _store(request).list_batches(None, limit + 1, request.query.get("after"))
    return web.json_response(_page([b.to_openai() | {"tenant": b.tenant} for b in batches],
                                   limit))


async def admin_get(request: web.Request) -> web.Response:
    require_admin(request)
    return await _found(request, await _store(request).get_batch(
        None, request.match_info["batch_id"]))


async def admin_cancel(request: web.Request) -> web.Response:
    require_admin(request)
    return await _found(request, await _store(request).cancel_batch(
        None, request.match_info["batch_id"]))


def add_routes(app: web.Application) -> None:
    """The endpoints above and :func:`batch_ctx` (store and runner)."""
    for method, path, handler in (
            ("POST", "/v1/files", create_file), ("GET", "/v1/files", list_files),
            ("GET", "/v1/files/{file_id}", get_file),
            ("GET", "/v1/files/{file_id}/content", file_content),
            ("DELETE", "/v1/files/{file_id}", delete_file),
            ("POST", "/v1/batches", create_batch), ("GET", "/v1/batches", list_batches),
            ("GET", "/v1/batches/{batch_id}", get_batch),
            ("POST", "/v1/batches/{batch_id}/cancel", cancel_batch),
            ("GET", "/admin/batches", admin_list),
            ("GET", "/admin/batches/{batch_id}", admin_get),
            ("POST", "/admin/batches/{batch_id}/cancel", admin_cancel)):
        app.router.add_route(method, path, _guarded(handler))
    app.cleanup_ctx.append(batch_ctx)
    app.on_shutdown.append(_stop_runner)


async def _stop_runner(app: web.Application) -> None:
    """Before the server drains: stop sending lines to it (a line sent then would
    find the socket closed)."""
    if RUNNER in app:
        await app[RUNNER].stop()


async def _open_store(app: web.Application) -> JobStore:
    """The job store, retried every :data:`STORE_RETRY_S` s while it cannot be opened
    (the gateway serves online traffic meanwhile; the Batch API answers 503)."""
    cfg = app[CONFIG].gateway.batch
    while True:
        try:
            return await open_job_store(cfg.store_url, cfg.dir)
        except STORE_ERRORS as e:
            log.error("batch store %s cannot be opened (%r); retrying in %d s",
                      cfg.store_url.split("@")[-1], e, STORE_RETRY_S)
            await asyncio.sleep(STORE_RETRY_S)


async def batch_ctx(app: web.Application) -> AsyncIterator[None]:
    """Runs this process's :class:`BatchRunner` (which sends nothing until
    :meth:`BatchRunner.serve_at` names the bound address) and opens its job store, in
    the background while the store is unreachable; the collector on ``/metrics``. On
    shutdown the runner hands back its leases."""
    cfg = app[CONFIG].gateway.batch
    runner = BatchRunner(None, cfg, app[SESSION], app[QUEUES], app[POOL],
                         app[DIRECTOR].placer if DIRECTOR in app else None,
                         app[CONFIG].gateway.slo,
                         app[DIRECTOR].mix if DIRECTOR in app else None, app[SLO_GATE])
    app[RUNNER] = runner
    collector = BatchCollector(runner)
    app[METRICS].registry.register(collector)

    async def start() -> None:
        runner.store = await _open_store(app)
        runner.start()

    opening = asyncio.create_task(start())
    with contextlib.suppress(TimeoutError):  # an embedded store opens at once
        await asyncio.wait_for(asyncio.shield(opening), 2.0)
    try:
        yield
    finally:
        opening.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await opening
        await runner.stop()
        app[METRICS].registry.unregister(collector)
        if runner.store is not None:
            await runner.store.close()
