"""The upstream call: one request to one engine over the shared ``ClientSession``.

Streaming answers are passed through as bytes: each network read is cut at SSE
event boundaries (never inside a UTF-8 character) and written to the client at
once, without decoding or re-encoding. For chat and completions the gateway always
asks the engine for usage (``stream_options.include_usage``); when the client did not
ask for it, the usage-only chunk is dropped and its other fields (vLLM's
``system_fingerprint``) are put back on the chunks that finished a choice, as the
engine writes them without ``include_usage`` (those chunks wait for the usage chunk).
The other endpoints' streams carry their usage in their own events
(:mod:`gateway.endpoints`).

Timeouts (``config.schema.Timeouts``): connect; first token (the first generated
output of a stream, or the whole answer when not streaming, bounded by
``non_stream_s``); idle (the gap between two complete events of a stream: bytes that
do not complete an event are no progress); and an optional total. One event may be at
most ``max_event_bytes`` long; a longer one ends the stream.

An engine's HTTP error status is mapped by whose fault it is (:func:`engine_error`):
the client's request (400/413/422, passed on as 400/413 in OpenAI shape), an
overloaded engine (429/503: another engine is tried, else 429/503 with the engine's
``Retry-After``), or the gateway's own (any other status: another engine is tried,
else 502).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from opentelemetry import trace

from config.schema import Timeouts
from engines.kinds import KINDS
from engines.pool import Engine
from gateway.endpoints import stream_summary, usage_counts
from gateway.errors import sse_error_event
from gateway.openai_api import PATHS, TOKEN_FREE, InferenceRequest
from gateway.sse import EventFramer, EventTooLarge, event_data
from limits.interfaces import Clock
from limits.outcome import Outcome, Rejected

log = logging.getLogger("sluice.proxy")

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class _RelayResponse(web.StreamResponse):
    """A stream response whose headers go out with its first body write (one send
    instead of two; the bytes on the wire are the same). ``prepare`` is only called
    right before that first write, so nothing is held back.

    Each write must be taken by the client within ``write_timeout_s``
    (``timeouts.client_write_s``): a client that stops reading would otherwise hold
    the write, the engine slot and the tenant's concurrency slot forever. Past it the
    connection is aborted and the write raises :class:`ConnectionResetError` (a client
    disconnect)."""

    _send_headers_immediately = False
    write_timeout_s: float | None = None

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        await self._bounded(super().write(data))

    async def write_eof(self, data: bytes = b"") -> None:
        await self._bounded(super().write_eof(data))

    async def _bounded(self, write: Awaitable[None]) -> None:
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await write
        except TimeoutError:
            request = self._req
            if request is not None and request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError(
                f"the client took no data for {self.write_timeout_s:g} s") from None


#: Bytes of an engine's error answer read for its message; the rest is dropped.
ERROR_BODY_BYTES = 64 * 1024


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """At most ``limit`` bytes of ``resp``'s body and whether that is all of it (a
    longer body is not read further; the caller closes the response).

    Raises:
        aiohttp.ClientError: the connection failed while reading."""
    if resp.content_length is not None and resp.content_length > limit:
        return b"", False
    buf = bytearray()
    async for chunk in resp.content.iter_any():
        buf += chunk
        if len(buf) > limit:
            return bytes(buf[:limit]), False
    return bytes(buf), True


class UpstreamFailed(Exception):
    """The engine could not answer before any byte reached the client, so another
    engine may be tried (``retryable``) or the error is final.

    Attributes:
        outcome: what happened (``UPSTREAM_ERROR``, ``UPSTREAM_TIMEOUT``,
            ``NO_ENGINE``, or ``RATE_LIMITED`` / ``OVERLOADED`` for an engine's 429/503).
        message: for logs (names the engine).
        final: the error for the client when no other engine answers, or None for
            the caller's default for ``outcome``.
    """

    def __init__(self, outcome: Outcome, message: str, *, retryable: bool,
                 final: Rejected | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message
        self.retryable = retryable
        self.final = final


class ClientGone(asyncio.CancelledError):
    """The client went away (the handler was cancelled) while a stream was relayed;
    carries what the engine had used by then, so it is charged: ``prompt_tokens``
    and ``completion_tokens`` (the engine's usage if it came, else the prompt
    estimate and the chunks that carried generated output)."""

    def __init__(self, prompt_tokens: int, completion_tokens: int) -> None:
        super().__init__("client disconnected mid-stream")
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens


@dataclass
class ProxyResult:
    """How an upstream call ended.

    Attributes:
        outcome: ``OK``, ``CLIENT_DISCONNECTED``, ``UPSTREAM_ERROR`` or
            ``UPSTREAM_TIMEOUT`` (the last two only after bytes reached the client).
        response: the HTTP response for the handler to return (already sent for
            streams).
        prompt_tokens / completion_tokens: from the engine's usage; for a stream cut
            short, the estimate and the chunks of generated output streamed so far.
        ttft_s: seconds from sending to the first generated output, or None.
        cached_tokens: ``usage.prompt_tokens_details.cached_tokens`` (prompt tokens
            the engine's prefix cache served), or None when it did not report it.
        answer: the complete answer as a non-streaming body (for the cache), or None
            if it did not finish normally.
    """

    outcome: Outcome
    response: web.StreamResponse
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    answer: dict[str, Any] | None
    finish_reasons: list[str]
    cached_tokens: int | None = None


def _json_object(raw: bytes) -> dict[str, Any] | None:
    """``raw`` decoded when it is a JSON object, else None. msgspec decodes valid JSON
    as ``json.loads`` does (exact integers included), about 5× faster; ``json`` gets
    what msgspec refuses and Python accepts (``NaN``, ``Infinity``)."""
    try:
        obj = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            return None
    return obj if isinstance(obj, dict) else None


def _usage(req: InferenceRequest, usage: Mapping[str, Any] | None,
           streamed: int) -> tuple[int, int, int | None]:
    """(prompt, generated, cached) tokens of an answer: the engine's usage
    (:func:`gateway.endpoints.usage_counts`), else the prompt estimate and the chunks
    streamed; nothing for the endpoints that cost no tokens (:data:`TOKEN_FREE`)."""
    if req.endpoint in TOKEN_FREE:
        return 0, 0, None
    counts = usage_counts(req.endpoint, usage)
    return counts if counts is not None else (req.prompt_tokens, streamed, None)


def _merge_trailer(held: list[bytes], trailer: Mapping[str, Any]) -> list[bytes]:
    """The chunks in ``held`` with the fields of the usage-only ``trailer`` chunk that
    they lack (not ``usage``, ``choices`` or ``metrics``, which ride on the usage
    chunk only), re-encoded; a chunk that is not JSON is kept as it was."""
    extra = {k: v for k, v in trailer.items() if k not in ("usage", "choices", "metrics")}
    out = []
    for ev in held:
        obj = _json_object(event_data(ev))
        if obj is None or all(k in obj for k in extra):
            out.append(ev)
            continue
        obj.update({k: v for k, v in extra.items() if k not in obj})
        out.append(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")
    return out


#: Engine statuses that blame the client's request (vLLM answers 400 for a prompt
#: past the context length or a bad sampling parameter).
CLIENT_FAULT = frozenset({400, 413, 422})
#: Engine statuses that mean "busy, come back later".
ENGINE_BUSY = {429: Outcome.RATE_LIMITED, 503: Outcome.OVERLOADED}


def _engine_message(raw: bytes) -> str | None:
    """The message of an engine's error body, if any: ``error.message`` (OpenAI,
    vLLM), a top-level ``message`` (older vLLM) or ``detail`` (FastAPI)."""
    body = _json_object(raw)
    if body is None:
        return None
    err = body.get("error") or body.get("message") or body.get("detail")
    if isinstance(err, dict):
        err = err.get("message")
    return str(err) if err else None


def retry_after_s(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delay-seconds or an HTTP-date
    (RFC 9110 §10.2.3); None when absent or unparsable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def engine_error(engine_id: str, status: int, headers: Mapping[str, str],
                 raw: bytes) -> Rejected | UpstreamFailed:
    """Map an engine's HTTP error answer (status >= 400) by whose fault it is.

    Returns:
        a :class:`Rejected` for the client's fault (400 ``invalid_request`` or
        ``context_length_exceeded``, 413), with the engine's message; otherwise a
        retryable :class:`UpstreamFailed` whose ``final`` error is 429/503 with the
        engine's ``Retry-After`` for an overloaded engine (429/503), the caller's 502
        for another 5xx, and a 502 for any other 4xx (the engine rejected the
        gateway's own credentials (401/403), does not serve the model (404), or
        refused the request the gateway built: a gateway fault, logged).
    """
    message = _engine_message(raw)
    if status in CLIENT_FAULT:
        text = message or f"The engine rejected the request (HTTP {status})."
        lowered = text.lower()
        # vLLM: "maximum context length"; llama.cpp: "exceeds the available context size"
        if any(k in lowered for k in ("context length", "maximum context", "too long",
                                      "context size")):
            return Rejected(Outcome.CONTEXT_LENGTH_EXCEEDED, text, param="messages")
        if status == 413:
            return Rejected(Outcome.BODY_TOO_LARGE, text)
        return Rejected(Outcome.INVALID_REQUEST, text)
    detail = f"engine {engine_id} answered HTTP {status}" + (f": {message}" if message else "")
    if status in ENGINE_BUSY:
        outcome = ENGINE_BUSY[status]
        return UpstreamFailed(outcome, detail, retryable=True, final=Rejected(
            outcome, "The model's engines are overloaded; retry after the Retry-After delay.",
            retry_after_s=retry_after_s(headers.get("Retry-After")), reason="engine_overloaded"))
    if status >= 500:
        return UpstreamFailed(Outcome.UPSTREAM_ERROR, detail, retryable=True)
    log.error("%s (a gateway fault: check the engine's URL, model name and credentials)", detail)
    return UpstreamFailed(Outcome.UPSTREAM_ERROR, detail, retryable=True, final=Rejected(
        Outcome.UPSTREAM_ERROR,
        f"The engine refused the gateway's request (HTTP {status}); this is a fault of the "
        "gateway's configuration, not of your request."))


class EngineClient:
    """Sends :class:`InferenceRequest` s to engines and relays the answers.

    Args:
        session: the shared client session (not closed here).
        timeouts: connect, first-token, idle and total limits, s.
        max_event_bytes: longest stream event relayed, bytes.
        max_response_bytes: longest non-streamed answer relayed, bytes.
        clock: measures TTFT, s (the app's clock). The timeouts are the event loop's
            timers (``asyncio.timeout``), so their deadlines are in ``loop.time()``.
    """

    def __init__(self, session: aiohttp.ClientSession, timeouts: Timeouts,
                 max_event_bytes: int, clock: Clock,
                 max_response_bytes: int = 64 * 1024 * 1024) -> None:
        self.session = session
        self.max_response_bytes = max_response_bytes
        self.clock = clock
        self.timeouts = timeouts
        self.max_event_bytes = max_event_bytes
        self._client_timeout = aiohttp.ClientTimeout(
            total=None, connect=timeouts.connect_s, sock_connect=timeouts.connect_s
        )

    def _upstream_body(self, req: InferenceRequest, priority: int | None) -> bytes:
        body = req.body
        if priority is not None or "priority" in body:  # the band decides, not the client
            body = {k: v for k, v in body.items() if k != "priority"}
            if priority is not None:
                body["priority"] = priority
        if req.stream and req.endpoint in ("chat", "completions"):
            opts = dict(body.get("stream_options") or {})
            opts["include_usage"] = True
            body = {**body, "stream_options": opts}
        return json.dumps(body, ensure_ascii=False).encode()

    async def _open(self, engine: Engine, req: InferenceRequest, headers: Mapping[str, str],
                    data: bytes) -> aiohttp.ClientResponse:
        # llama-server drops the connection after a stream while announcing keep-alive:
        # a pooled connection would fail the next request (engines.kinds.llamacpp)
        close = req.stream and KINDS[engine.labels.get("dialect", "vllm")].close_after_stream
        try:
            resp = await self.session.post(
                engine.base_url + PATHS[req.endpoint],
                data=data,
                headers={"Content-Type": "application/json",
                         **({"Connection": "close"} if close else {}), **headers},
                timeout=self._client_timeout,
            )
        except (aiohttp.ClientConnectionError, OSError) as e:
            raise UpstreamFailed(Outcome.NO_ENGINE, f"engine {engine.id} unreachable: {e}",
                                 retryable=True) from None
        encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):  # asked for identity (gateway.app's session)
            resp.close()
            log.error("engine %s answered with Content-Encoding %r although asked for "
                      "identity; the gateway relays bytes as they arrive and cannot "
                      "decode them", engine.id, encoding)
            raise UpstreamFailed(Outcome.UPSTREAM_ERROR,
                                 f"engine {engine.id} sent a {encoding}-encoded answer",
                                 retryable=True)
        if resp.status >= 400:
            try:
                raw, whole = await read_capped(resp, ERROR_BODY_BYTES)
            except aiohttp.ClientError:
                raw, whole = b"", False
            if whole:
                resp.release()
            else:
                resp.close()
            raise engine_error(engine.id, resp.status, resp.headers, raw)
        return resp

    async def send(self, engine: Engine, req: InferenceRequest, request: web.Request,
                   response_headers: Mapping[str, str],
                   upstream_headers: Mapping[str, str] = {},
                   on_first_token: Callable[[], None] | None = None,
                   priority: int | None = None,
                   on_answer: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
                   ) -> ProxyResult:
        """Send ``req`` to ``engine`` and relay the answer to ``request``'s client;
        ``on_first_token`` is called when the first generated output arrives (for a
        non-streaming answer: when the whole answer arrives). ``priority``: vLLM's
        ``priority`` field to send (a client's own ``priority`` is never forwarded).

        Raises:
            UpstreamFailed: nothing was sent to the client yet (retry is safe).
            Rejected: the engine rejected the client's request (see :func:`engine_error`).
            asyncio.CancelledError: the client went away; the upstream request is
                closed first, which makes vLLM abort it. Mid-stream it is a
                :class:`ClientGone` carrying the tokens used so far.
        """
        start = self.clock.now()
        data = await asyncio.to_thread(self._upstream_body, req, priority) if req.large \
            else self._upstream_body(req, priority)
        try:
            async with asyncio.timeout(self.timeouts.first_token_s if req.stream
                                       else self.timeouts.non_stream_s):
                resp = await self._open(engine, req, upstream_headers, data)
                if not req.stream:
                    raw, whole = await read_capped(resp, self.max_response_bytes)
                    if whole:
                        resp.release()  # the connection goes back to the pool
                    else:
                        resp.close()
                        raise UpstreamFailed(
                            Outcome.UPSTREAM_ERROR,
                            f"engine {engine.id}'s answer exceeds max_response_bytes",
                            retryable=False, final=Rejected(
                                Outcome.UPSTREAM_ERROR,
                                "The engine's answer is longer than the gateway relays "
                                f"({self.max_response_bytes} bytes); ask for fewer tokens "
                                "or stream it."))
        except TimeoutError:
            raise UpstreamFailed(Outcome.UPSTREAM_TIMEOUT,
                                 f"engine {engine.id} did not answer in time",
                                 retryable=False) from None
        except aiohttp.ClientError as e:
            raise UpstreamFailed(Outcome.UPSTREAM_ERROR, f"engine {engine.id} failed: {e}",
                                 retryable=True) from None
        if not req.stream:
            if on_first_token is not None:
                on_first_token()
            result = self._finish_json(req, raw, start, response_headers)
            if on_answer is not None and result.answer is not None:
                await on_answer(result.answer)
            return result
        try:
            return await self._relay_stream(engine, req, resp, request, start, response_headers,
                                            on_first_token, on_answer)
        finally:
            resp.close()

    def _finish_json(self, req: InferenceRequest, raw: bytes, start: float,
                     headers: Mapping[str, str]) -> ProxyResult:
        answer = _json_object(raw)
        if answer is None:
            raise UpstreamFailed(Outcome.UPSTREAM_ERROR, "engine sent invalid JSON",
                                 retryable=True)
        prompt, completion, cached = _usage(req, answer.get("usage"), 0)
        reasons = [c.get("finish_reason") for c in answer.get("choices") or ()] + [
            answer.get("stop_reason") if req.endpoint == "messages" else None,
            answer.get("status") if req.endpoint == "responses" else None]
        return ProxyResult(
            outcome=Outcome.OK,
            response=web.Response(body=raw, content_type="application/json", headers=headers),
            prompt_tokens=prompt, completion_tokens=completion,
            ttft_s=self.clock.now() - start, answer=answer,
            cached_tokens=cached,
            finish_reasons=[r for r in reasons if isinstance(r, str) and r],
        )

    async def _relay_stream(self, engine: Engine, req: InferenceRequest,
                            resp: aiohttp.ClientResponse, request: web.Request, start: float,
                            headers: Mapping[str, str],
                            on_first_token: Callable[[], None] | None,
                            on_answer: Callable[[dict[str, Any]], Awaitable[None]] | None,
                            ) -> ProxyResult:
        t = self.timeouts
        loop = asyncio.get_running_loop()
        end_at = loop.time() + t.total_s if t.total_s else float("inf")
        framer = EventFramer(self.max_event_bytes)
        summary = stream_summary(req.endpoint)
        #: chat/completions without the client's include_usage: the engine's usage
        #: chunk is dropped, and the chunks that finish a choice wait for its fields
        trailer = req.endpoint in ("chat", "completions") and not req.client_usage
        held: list[bytes] = []
        ttft: float | None = None
        out = _RelayResponse(status=200, headers={**SSE_HEADERS, **headers})
        out.write_timeout_s = t.client_write_s
        outcome = Outcome.OK
        message: str | None = None
        prepared = False
        try:
            async with asyncio.timeout_at(min(loop.time() + t.first_token_s, end_at)) as deadline:
                while True:
                    chunk = await resp.content.readany()
                    if not chunk:
                        break
                    events = framer.feed(chunk)
                    if not events:
                        continue  # an unfinished event is no progress: the deadline stands
                    keep = []
                    for ev in events:
                        obj = summary.observe(ev)
                        if trailer and obj is not None:
                            if obj.get("usage") and not obj.get("choices"):
                                keep += _merge_trailer(held, obj)  # the usage-only chunk
                                held = []
                                continue
                            if any(c.get("finish_reason") for c in obj.get("choices") or ()):
                                held.append(ev)
                                continue
                        if held and summary.done:  # [DONE] without a usage chunk
                            keep += held
                            held = []
                        keep.append(ev)
                    if summary.done and on_answer is not None and not summary.error \
                            and (answer := summary.to_response()) is not None:
                        await on_answer(answer)
                    if ttft is None and (summary.content_chunks or summary.finish_reasons):
                        ttft = self.clock.now() - start
                        trace.get_current_span().add_event("first_token")
                        if on_first_token is not None:
                            on_first_token()
                    deadline.reschedule(min(
                        loop.time() + (t.first_token_s if ttft is None else t.idle_s), end_at))
                    if not prepared:
                        await out.prepare(request)
                        prepared = True
                    if keep:
                        await out.write(keep[0] if len(keep) == 1 else b"".join(keep))
                    if summary.done:
                        break
        except TimeoutError:
            outcome = Outcome.UPSTREAM_TIMEOUT
        except EventTooLarge:
            outcome = Outcome.UPSTREAM_ERROR
            message = (f"The engine sent a stream event longer than {self.max_event_bytes} bytes "
                       "(gateway max_event_bytes).")
            log.warning("engine %s: %s", engine.id, message)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
            if isinstance(e, ConnectionResetError) or (
                    request.transport is None or request.transport.is_closing()):
                outcome = Outcome.CLIENT_DISCONNECTED
            else:
                outcome = Outcome.UPSTREAM_ERROR
        except ConnectionResetError:
            outcome = Outcome.CLIENT_DISCONNECTED
        except asyncio.CancelledError:
            prompt, completion, _ = _usage(req, summary.usage, summary.content_chunks)
            raise ClientGone(prompt, completion) from None
        if outcome is Outcome.OK and not summary.done:
            outcome = Outcome.UPSTREAM_ERROR  # the engine closed the stream early
        if outcome is Outcome.OK and summary.error:
            outcome = Outcome.UPSTREAM_ERROR
        if not prepared and outcome in (Outcome.UPSTREAM_ERROR, Outcome.UPSTREAM_TIMEOUT):
            if message is not None:  # the same request would likely grow the same event
                raise UpstreamFailed(outcome, f"engine {engine.id}: {message}", retryable=False,
                                     final=Rejected(outcome, message))
            raise UpstreamFailed(outcome, f"engine {engine.id} failed before the first token",
                                 retryable=outcome is Outcome.UPSTREAM_ERROR)
        if outcome in (Outcome.UPSTREAM_ERROR, Outcome.UPSTREAM_TIMEOUT) and not summary.error:
            message = message or ("The engine stopped responding mid-stream." if outcome is
                                  Outcome.UPSTREAM_TIMEOUT else "The engine failed mid-stream.")
            try:
                await out.write(sse_error_event(outcome, message,
                                                anthropic=req.endpoint == "messages"))
            except ConnectionResetError:
                outcome = Outcome.CLIENT_DISCONNECTED
        if prepared and outcome is not Outcome.CLIENT_DISCONNECTED:
            try:
                await out.write_eof()
            except ConnectionResetError:
                outcome = Outcome.CLIENT_DISCONNECTED
        prompt, completion, cached = _usage(req, summary.usage, summary.content_chunks)
        return ProxyResult(
            outcome=outcome, response=out, prompt_tokens=prompt, completion_tokens=completion,
            ttft_s=ttft, answer=summary.to_response() if outcome is Outcome.OK else None,
            finish_reasons=list(summary.finish_reasons.values()),
            cached_tokens=cached,
        )

