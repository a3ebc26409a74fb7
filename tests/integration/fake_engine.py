"""A small OpenAI/vLLM-shaped engine served over real loopback HTTP, with switches
for the failure modes the gateway must survive.

It speaks the same API as vLLM (``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses``, Anthropic ``/v1/messages`` and ``/v1/messages/count_tokens``,
``/v1/embeddings``, ``/tokenize``, ``/detokenize``, ``/v1/models``, ``/health``,
``/metrics`` from the shared vLLM exposition writer; shapes as vLLM 0.32's, with a
``system_fingerprint`` stamped as vLLM does when one is set) and records what it
received. A chat answer may first stream ``reasoning`` (one word per
``reasoning_content`` delta; the JSON answer's ``message.reasoning_content``), and
its ``reply`` words go in the delta field ``stream_field``: ``content``, or
``tool_calls`` (pieces of one call's ``function.arguments``, after a piece with its
``id`` and name); every answer ends with ``finish_reason``. ``mode`` selects a
behaviour for the next requests:

* ``ok``: the answer ``reply`` (streamed one word per chunk, usage when asked).
* ``split_utf8``: the stream's bytes are written in 3-byte pieces, so multi-byte
  characters are cut between writes.
* ``die_mid_stream``: ``die_at`` chunks (default two), then the connection is dropped.
* ``slow_first``: waits ``delay_s`` before the first chunk (or the JSON answer).
* ``stall``: two chunks (role, first word), then waits ``delay_s`` before the next.
* ``error500``: answers HTTP 500.
* ``status``: answers HTTP ``status`` with an OpenAI error body carrying
  ``error_message`` and the headers ``error_headers`` (e.g. 429 with Retry-After).
* ``raw``: answers HTTP 200 with the bytes ``raw_body`` as ``application/json``.
* ``unbounded_event``: a chat stream's role chunk and first word (a completions
  stream: nothing), then ``data: {"x":"`` and 64 KiB of text every ``delay_s``, never a blank line,
  until the client goes away (``sent_bytes`` counts what was written).

``compress``, independent of ``mode``: ``"asked"`` compresses every answer (JSON,
streams, probes) with gzip or deflate when the request's ``Accept-Encoding`` allows it,
as aiohttp, vLLM behind nginx or a CDN does; ``"always"`` gzips the inference answers
whatever was asked (a misbehaving proxy; probes stay plain).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.web import ContentCoding
from multidict import CIMultiDict

from loadtest.sim_engine.metrics import EngineStats, VllmExposition


def _pieces(text: str) -> list[str]:
    """``text`` cut after each space: the words as an engine streams them."""
    words = text.split(" ")
    return [w + " " for w in words[:-1]] + words[-1:]


@dataclass
class FakeEngine:
    model: str = "fake-model"
    reply: str = "Hello from the fake engine, naïve café 日本語 🚀 done."
    mode: str = "ok"
    reasoning: str = ""
    stream_field: str = "content"
    die_at: int = 2
    finish_reason: str = "stop"
    kv_usage: float = 0.1
    delay_s: float = 0.0
    status: int = 500
    error_message: str = "boom"
    error_headers: dict[str, str] = field(default_factory=dict)
    raw_body: bytes = b""
    compress: str = ""
    sent_bytes: int = 0
    running: int = 0
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[CIMultiDict[str]] = field(default_factory=list)
    aborted: int = 0
    system_fingerprint: str | None = None
    runner: web.AppRunner | None = None
    port: int = 0
    exposition: VllmExposition = field(init=False)

    def __post_init__(self) -> None:
        self.exposition = VllmExposition(self.model, lambda: EngineStats(
            running=self.running, kv_cache_usage=self.kv_usage))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> FakeEngine:
        app = web.Application(client_max_size=64 * 1024 * 1024,  # vLLM has no 1 MiB cap
                              middlewares=[self._compress])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def _encode(self, response: web.StreamResponse, path: str) -> web.StreamResponse:
        """Apply ``compress`` to a response to ``path`` not sent yet."""
        if self.compress == "asked":
            response.enable_compression()  # only what Accept-Encoding allows
        elif self.compress == "always" and path.startswith("/v1/c"):
            response.enable_compression(ContentCoding.gzip)
        return response

    @web.middleware
    async def _compress(self, request: web.Request, handler: Any) -> web.StreamResponse:
        response = await handler(request)
        return response if response.prepared else self._encode(response, request.path)

    # ---------------------------------------------------------------- handlers

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": 1700000000, "owned_by": "vllm",
            "root": f"/models/{self.model}", "parent": None, "max_model_len": 2048}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.exposition.render(), content_type="text/plain")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=False)

    async def _answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.headers.append(request.headers.copy())
        if self.mode == "error500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if self.mode == "status":
            err = {"message": self.error_message, "type": "BadRequestError", "param": None,
                   "code": self.status}
            return web.json_response({"error": err}, status=self.status, headers=self.error_headers)
        if self.mode == "raw":
            return web.Response(body=self.raw_body, content_type="application/json")
        self.running += 1
        try:
            if body.get("stream"):
                return await self._stream(request, body, chat)
            if self.mode == "slow_first":
                await asyncio.sleep(self.delay_s)
            return web.json_response(self._full(body, chat))
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        finally:
            self.running -= 1

    def _words(self, body: dict[str, Any]) -> list[str]:
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
        return _pieces(" ".join(self.reply.split(" ")[:cap]))

    def _usage(self, body: dict[str, Any]) -> dict[str, int]:
        n = len(self._words(body))
        return {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}

    def _full(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        text = "".join(self._words(body))
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason,
                                  "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            if self.reasoning:
                choice["message"]["reasoning_content"] = self.reasoning
        else:
            choice["text"] = text
        return {"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": body["model"], "choices": [choice],
                "usage": self._usage(body)}

    def _chunks(self, body: dict[str, Any], chat: bool) -> list[bytes]:
        base = {"id": "cmpl-fake", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": body["model"]}
        out = []
        if chat:
            out.append({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None}]})
        deltas = [{"reasoning_content": w} for w in _pieces(self.reasoning)] \
            if self.reasoning else []
        if self.stream_field == "tool_calls":
            deltas.append({"tool_calls": [{"index": 0, "id": "call-1", "type": "function",
                                           "function": {"name": "lookup", "arguments": ""}}]})
            deltas += [{"tool_calls": [{"index": 0, "function": {"arguments": w}}]}
                       for w in self._words(body)]
        else:
            deltas += [{"content": w} for w in self._words(body)]
        for delta in deltas if chat else ():
            out.append({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        for w in () if chat else self._words(body):
            out.append({**base, "choices": [{"index": 0, "text": w, "finish_reason": None}]})
        last = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
        usage = (body.get("stream_options") or {}).get("include_usage")
        fp = {"system_fingerprint": self.system_fingerprint} if self.system_fingerprint else {}
        out.append({**base, "choices": [{**last, "finish_reason": self.finish_reason}],
                    **({} if usage else fp)})
        if usage:
            out.append({**base, "choices": [], "usage": self._usage(body), **fp})
        return [b"data: " + json.dumps(c, ensure_ascii=False).encode() + b"\n\n" for c in out] + [
            b"data: [DONE]\n\n"]

    async def _stream(self, request: web.Request, body: dict[str, Any], chat: bool) -> web.StreamResponse:
        resp = self._encode(web.StreamResponse(headers={"Content-Type": "text/event-stream"}),
                            request.path)
        await resp.prepare(request)
        chunks = self._chunks(body, chat)
        if self.mode == "slow_first":
            await asyncio.sleep(self.delay_s)
        if self.mode == "unbounded_event":
            for chunk in chunks[:2 if chat else 0]:
                await resp.write(chunk)
            await resp.write(b'data: {"x":"')
            while True:
                await resp.write(b"y" * 65536)
                self.sent_bytes += 65536
                await asyncio.sleep(self.delay_s)
        for i, chunk in enumerate(chunks):
            if self.mode == "die_mid_stream" and i == self.die_at:
                assert request.transport is not None
                request.transport.abort()
                return resp
            if self.mode == "stall" and i == 2:
                await asyncio.sleep(self.delay_s)
            if self.mode == "split_utf8":
                for j in range(0, len(chunk), 3):
                    await resp.write(chunk[j:j + 3])
                    await asyncio.sleep(0)
            else:
                await resp.write(chunk)
            if self.delay_s and self.mode == "ok":
                await asyncio.sleep(self.delay_s)
        await resp.write_eof()
        return resp

    # ------------------------------------------------------- the other endpoints

    async def _record(self, request: web.Request) -> dict[str, Any] | web.Response:
        body = await request.json()
        self.received.append(body)
        self.headers.append(request.headers.copy())
        if self.mode == "status":
            err = {"message": self.error_message, "type": "BadRequestError", "param": None,
                   "code": self.status}
            return web.json_response({"error": err}, status=self.status,
                                     headers=self.error_headers)
        return body

    @staticmethod
    def _events(events: list[tuple[str, dict[str, Any]]]) -> bytes:
        return b"".join(f"event: {name}\ndata: ".encode() + json.dumps(
            obj, ensure_ascii=False).encode() + b"\n\n" for name, obj in events)

    async def _sse(self, request: web.Request, payload: bytes) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(payload)
        await resp.write_eof()
        return resp

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        if isinstance(body, web.Response):
            return body
        if body.get("previous_response_id"):  # as vLLM without its response store
            return web.json_response({"error": {"message": "Response not found",
                                                "type": "invalid_request_error"}}, status=404)
        words = self._words({"max_tokens": body.get("max_output_tokens")})
        text = "".join(words)
        rid = f"resp_{uuid.uuid4().hex}"
        message = {"id": f"msg_{rid}", "type": "message", "role": "assistant",
                   "status": "completed",
                   "content": [{"type": "output_text", "text": text, "annotations": []}]}
        response = {
            "id": rid, "object": "response", "created_at": int(time.time()),
            "model": body["model"], "status": "completed", "output": [message],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "usage": {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": len(words),
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": 7 + len(words)}}
        if not body.get("stream"):
            return web.json_response(response)
        head = {**response, "status": "in_progress", "output": [], "usage": None}
        events = [("response.created", {"type": "response.created", "response": head,
                                        "sequence_number": 0})]
        events += [("response.output_text.delta", {
            "type": "response.output_text.delta", "item_id": message["id"],
            "output_index": 0, "content_index": 0, "delta": w, "logprobs": [],
            "sequence_number": i + 1}) for i, w in enumerate(words)]
        events.append(("response.completed", {"type": "response.completed",
                                              "response": response,
                                              "sequence_number": len(words) + 1}))
        return await self._sse(request, self._events(events))

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        if isinstance(body, web.Response):
            return body
        words = self._words({"max_tokens": body.get("max_tokens")})
        usage = {"input_tokens": 7, "output_tokens": len(words)}
        message = {"id": "msg_fake", "type": "message", "role": "assistant",
                   "model": body["model"], "content": [{"type": "text", "text": "".join(words)}],
                   "stop_reason": "end_turn", "stop_sequence": None, "usage": usage}
        if not body.get("stream"):
            return web.json_response(message)
        events = [("message_start", {"type": "message_start", "message": {
            **message, "content": [], "stop_reason": None,
            "usage": {"input_tokens": 7, "output_tokens": 0}}}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}})]
        events += [("content_block_delta", {"type": "content_block_delta", "index": 0,
                                            "delta": {"type": "text_delta", "text": w}})
                   for w in words]
        events += [("content_block_stop", {"type": "content_block_stop", "index": 0}),
                   ("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                      "usage": usage}),
                   ("message_stop", {"type": "message_stop"})]
        return await self._sse(request, self._events(events))

    async def _count_tokens(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        return body if isinstance(body, web.Response) else web.json_response({"input_tokens": 7})

    async def _embeddings(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        if isinstance(body, web.Response):
            return body
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        tokens = sum(len(str(i).split()) for i in inputs)
        return web.json_response({
            "id": "embd-fake", "object": "list", "created": int(time.time()),
            "model": body["model"],
            "data": [{"object": "embedding", "index": i,
                      "embedding": [len(str(x)) / 10, 0.5, -0.25]} for i, x in enumerate(inputs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        if isinstance(body, web.Response):
            return body
        tokens = [ord(c) for c in body.get("prompt") or ""]
        return web.json_response({"count": len(tokens), "max_model_len": 2048,
                                  "tokens": tokens, "token_strs": None})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        if isinstance(body, web.Response):
            return body
        return web.json_response({"prompt": "".join(chr(t) for t in body["tokens"])})
