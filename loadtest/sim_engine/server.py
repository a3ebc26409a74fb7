"""HTTP front of the simulated engine: vLLM's OpenAI-compatible routes over aiohttp.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming or not),
``GET /health``, ``GET /v1/models``, ``GET /metrics``, and the simulator's own
``GET``/``POST /sim/speed`` (read or change the speed factor at run time: body
``{"speed": 0.5}``; 400 unless it is a positive number) and ``GET /sim/stats`` (the
token counters, in every dialect: ``{"prompt_tokens", "generation_tokens", …}``, so a
test can see work arrive at an engine without ``/metrics``), ``GET /props`` in the
llama.cpp dialect. A client that disconnects
aborts its request at once (the app must be served with
``handler_cancellation=True``, as :func:`serve` does): it stops counting as running
and its KV blocks are freed, as vLLM aborts requests whose connection closed.

With a KV connector (:mod:`loadtest.sim_engine.disagg`) requests may carry
``kv_transfer_params`` (prefill and decode legs of a disaggregated request), the
non-streamed response carries ``kv_transfer_params`` (null when there are none, as
vLLM's), and ``POST /sim/nixl/read`` serves other engines' reads. ``X-Request-Id``
becomes the response id, as in vLLM.

With ``compress`` (``--compress``) every answer, streams included, is compressed
(gzip or deflate) whenever the request's ``Accept-Encoding`` allows it, as an engine
behind nginx or a CDN would: a client that offers gzip must be able to decode it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from engines.blocks import chain_block_hashes, fallback_tokenize
from loadtest.sim_engine.dialects import DIALECTS, Dialect
from loadtest.sim_engine.disagg import (
    CONNECTOR,
    READ_PATH,
    KVLoadFailed,
    SimConnector,
    engine_request_id,
    handle_read,
)
from loadtest.sim_engine.engine import SimEngine
from loadtest.sim_engine.protocol import (
    SSE_DONE,
    ParsedRequest,
    RequestError,
    ResponseShape,
    check_length,
    dumps,
    parse_chat,
    parse_completion,
)
from loadtest.sim_engine.scheduler import SimRequest, Status

ENGINE = web.AppKey("sim_engine", SimEngine)
DIALECT = web.AppKey("sim_dialect", Dialect)
COMPRESS = web.AppKey("sim_compress", bool)

#: Prompts longer than this (characters or token ids) are tokenised and hashed in
#: a worker thread so the event loop keeps serving streams meanwhile (~8 MB/s).
INLINE_PROMPT_LIMIT = 16_384
#: Largest request body, bytes (Mooncake prompts reach ~350 KB of text).
MAX_BODY_BYTES = 64 * 1024 * 1024


@web.middleware
async def _compress(request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                    ) -> web.StreamResponse:
    response = await handler(request)
    if not response.prepared:
        response.enable_compression()  # only what Accept-Encoding allows
    return response


def create_app(engine: SimEngine, connector: SimConnector | None = None,
               dialect: str = "vllm", compress: bool = False) -> web.Application:
    """The aiohttp app serving ``engine`` (and ``connector``'s read channel, if any) in
    ``dialect`` (:data:`~loadtest.sim_engine.dialects.DIALECTS`: which routes exist, the
    metrics page, the error form), compressing answers when asked if ``compress``; its
    step loop runs in ``cleanup_ctx``."""
    d = DIALECTS[dialect]
    app = web.Application(client_max_size=MAX_BODY_BYTES,
                          middlewares=[_compress] if compress else [])
    app[ENGINE] = engine
    app[DIALECT] = d
    app[COMPRESS] = compress
    if connector is not None:
        app[CONNECTOR] = connector
        app.router.add_post(READ_PATH, handle_read)
    app.router.add_post("/v1/chat/completions", _chat)
    if d.completions:
        app.router.add_post("/v1/completions", _completions)
    if d.health:
        app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    if d.metrics_path:
        app.router.add_get(d.metrics_path, _metrics)
    if d.props:
        app.router.add_get("/props", _props)
    app.router.add_get("/sim/speed", _speed)
    app.router.add_post("/sim/speed", _speed)
    app.router.add_get("/sim/stats", _stats)
    app.cleanup_ctx.append(_engine_loop)
    return app


async def serve(engine: SimEngine, host: str, port: int,
                connector: SimConnector | None = None, dialect: str = "vllm",
                compress: bool = False) -> web.AppRunner:
    """Start serving ``engine`` on ``host:port`` in ``dialect``; returns the runner
    (``cleanup()`` to stop). ``connector`` advertises ``host:port`` as its read channel."""
    if connector is not None:
        connector.host, connector.port = host, port
    runner = web.AppRunner(create_app(engine, connector, dialect, compress),
                           handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def _engine_loop(app: web.Application) -> AsyncIterator[None]:
    engine = app[ENGINE]
    tasks = [asyncio.create_task(engine.run())]
    if engine.publisher is not None:
        tasks.append(asyncio.create_task(engine.publisher.serve_replay()))
    yield
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if engine.publisher is not None:
        engine.publisher.close()
    if CONNECTOR in app:
        await app[CONNECTOR].close()


def _error(exc: RequestError, dialect: Dialect) -> web.Response:
    body = (dialect.error_body(exc.message, exc.err_type, exc.status) if dialect.error_body
            else exc.body())
    return web.Response(body=dumps(body), status=exc.status, content_type="application/json")


def _tokens_and_hashes(parsed: ParsedRequest, block_size: int) -> tuple[list[int], list[int]]:
    tokens = (parsed.prompt_token_ids if parsed.prompt_token_ids is not None
              else fallback_tokenize(parsed.prompt_text or ""))
    return tokens, chain_block_hashes(tokens, block_size, parsed.cache_salt)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"JSON decode error: {exc}") from None
        parsed = (parse_chat if chat else parse_completion)(body, engine.model_name)
        size = len(parsed.prompt_token_ids or parsed.prompt_text or "")
        if size > INLINE_PROMPT_LIMIT:
            tokens, hashes = await asyncio.to_thread(
                _tokens_and_hashes, parsed, engine.profile.block_size)
        else:
            tokens, hashes = _tokens_and_hashes(parsed, engine.profile.block_size)
        n_prompt = len(tokens)
        max_tokens = check_length(n_prompt, parsed.max_tokens, engine.profile.max_model_len)
        params = body.get("kv_transfer_params")
        if params is not None and not isinstance(params, dict):
            raise RequestError("kv_transfer_params must be an object",
                               param="kv_transfer_params")
        priority = body.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RequestError("priority must be an integer", param="priority")
        if priority != 0 and engine.scheduler.policy != "priority":
            # vllm/v1/engine/processor.py (process_inputs)
            raise RequestError(f"Got priority {priority} but Priority scheduling is "
                               "not enabled.", param="priority")
    except RequestError as exc:
        return _error(exc, request.app[DIALECT])
    connector = request.app.get(CONNECTOR)
    shape = ResponseShape(chat, engine.model_name, request.headers.get("X-Request-Id"),
                          reasoning_tokens=max_tokens // 2 if parsed.thinking else 0)
    wake = asyncio.Event()
    reqs = [SimRequest(engine_request_id(shape.id if parsed.n == 1 else f"{shape.id}-{i}"),
                       n_prompt, hashes, max_tokens, priority=priority, notify=wake.set,
                       token_ids=tokens if engine.publisher is not None else [],
                       cache_salt=parsed.cache_salt)
            for i in range(parsed.n)]
    engine.priorities.labels(str(priority)).inc()
    # the API server's turn (cancelled on disconnect); vLLM stamps a request's arrival
    # when its processor has taken it in (vllm/v1/engine/processor.py), so the time
    # queued before counts in no histogram either
    await engine.frontend.intake()
    arrival = engine.clock.now()
    # the connector's legs are single-sequence requests (vLLM's proxy sends n = 1)
    legs = connector if connector is not None and parsed.n == 1 else None
    if legs is not None and legs.remote_prefill(params):
        local = len(engine.kv.longest_prefix(hashes, n_prompt))
        try:
            reqs[0].external_tokens = await legs.load(params, n_prompt, local)
        except KVLoadFailed as exc:
            return _error(RequestError(str(exc), 500, "InternalServerError"),
                          request.app[DIALECT])
    reqs[0].keep_blocks = legs is not None and legs.remote_decode(params)
    for req in reqs:
        engine.submit(req)
        req.arrival_s = arrival  # TTFT counts the transfer, as vLLM's does
    try:
        if parsed.stream:
            return await _stream(request, reqs, wake, shape, parsed.include_usage,
                                 engine.prompt_tokens_details)
        while not all(req.done for req in reqs):
            await wake.wait()
            wake.clear()
        await engine.frontend.output(sum(r.num_output_tokens for r in reqs))
        extra = None if connector is None else {
            "kv_transfer_params": None if legs is None else legs.hold(reqs[0])}
        return web.Response(body=shape.full([r.num_output_tokens for r in reqs],
                                            n_prompt, sum(r.num_output_tokens for r in reqs),
                                            extra, _cached(engine, reqs[0])),
                            content_type="application/json")
    finally:
        for req in reqs:
            engine.abort(req)  # no-op once finished; frees blocks on disconnect/cancel
        if legs is not None and reqs[0].keep_blocks:
            legs.hold(reqs[0])  # a finished prefill's blocks wait for their read


def _cached(engine: SimEngine, req: SimRequest) -> int | None:
    """Cached prompt tokens for the usage (None unless the engine reports prompt
    token details)."""
    return req.num_cached_tokens if engine.prompt_tokens_details else None


async def _stream(request: web.Request, reqs: list[SimRequest], wake: asyncio.Event,
                  shape: ResponseShape, include_usage: bool,
                  details: bool) -> web.StreamResponse:
    """Stream the ``n`` sequences of one request, each as choice ``index`` i; each
    batch of new tokens waits its turn through the engine's front end first."""
    frontend = request.app[ENGINE].frontend
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache"})
    if request.app[COMPRESS]:
        resp.enable_compression()  # only what Accept-Encoding allows
    await resp.prepare(request)
    sent = [0] * len(reqs)
    while True:
        await wake.wait()
        wake.clear()
        parts: list[bytes] = []
        produced_now: list[int] = []
        for index, req in enumerate(reqs):
            produced = req.num_output_tokens
            if produced > sent[index]:
                produced_now.append(produced - sent[index])
                # vLLM sends the chat role chunk with the first engine output.
                if shape.chat and sent[index] == 0:
                    parts.append(shape.role_chunk(index))
                last = req.max_tokens if req.status is Status.FINISHED else -1
                parts += [shape.token_chunk(i, i + 1 == last, index)
                          for i in range(sent[index], produced)]
                sent[index] = produced
        if parts:
            await frontend.output(sum(produced_now))
            await resp.write(b"".join(parts))
        if all(req.done for req in reqs):
            break
    if all(req.status is Status.FINISHED for req in reqs):
        cached = reqs[0].num_cached_tokens if details else None
        tail = (shape.usage_chunk(reqs[0].num_prompt_tokens, sum(sent), cached)
                if include_usage else b"")
        await resp.write(tail + SSE_DONE)
    await resp.write_eof()
    return resp


async def _speed(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if request.method == "POST":
        try:
            speed = (await request.json()).get("speed")
        except (ValueError, AttributeError):
            speed = None
        if isinstance(speed, bool) or not isinstance(speed, int | float) or not speed > 0:
            return _error(RequestError("speed must be a positive number", param="speed"),
                          request.app[DIALECT])
        engine.set_speed(float(speed))
    return web.json_response({"speed": engine.speed})


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    name = engine.model_name
    return web.Response(body=dumps({"object": "list", "data": [{
        "id": name, "object": "model", "created": int(time.time()),
        "owned_by": request.app[DIALECT].owned_by,
        "root": name, "parent": None, "max_model_len": engine.profile.max_model_len,
    }]}), content_type="application/json")


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(dataclasses.asdict(request.app[ENGINE].scheduler.counters))


async def _props(request: web.Request) -> web.Response:
    props = request.app[DIALECT].props
    assert props is not None  # the route exists only with props
    return web.json_response(props(request.app[ENGINE]))


async def _metrics(request: web.Request) -> web.Response:
    render = request.app[DIALECT].render
    assert render is not None  # the route exists only with a page
    body, content_type = render(request.app[ENGINE])
    return web.Response(body=body, headers={"Content-Type": content_type})
