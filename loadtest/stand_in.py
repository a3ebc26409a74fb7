"""A minimal, fast OpenAI engine stand-in for overhead benchmarks.

``python -m loadtest.stand_in --port P [--model NAME] [--chunks N]``

A raw asyncio HTTP/1.1 server (keep-alive, no pipelining) that answers instantly:
``POST /v1/chat/completions`` and ``/v1/completions`` with a fixed answer (JSON, or
SSE with ``--chunks`` content chunks, a finish chunk, the usage chunk when
``stream_options.include_usage`` is set, and ``[DONE]``; each event is written as
its own chunked-encoding frame), ``POST /v1/responses`` (non-streaming: a completed
OpenAI Responses object with the same text and usage), ``GET /health``, ``GET /v1/models`` and
``GET /metrics`` with vLLM's metric names (idle engine, a large KV cache), so the
gateway's supervisor treats it as a ready ``external`` engine. Responses are built
once at start-up; per request the server only parses the head and the JSON body, so
it costs a fraction of what any proxy in front of it costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from loadtest.sim_engine.metrics import EngineStats, VllmExposition

_REASONS = {200: b"OK", 404: b"Not Found", 400: b"Bad Request"}


def _response(status: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
            % (status, _REASONS[status], content_type, len(body))) + body


def _frame(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Answers:
    """The prebuilt responses for one model name."""

    def __init__(self, model: str, chunks: int) -> None:
        self.model = model
        usage = {"prompt_tokens": 12, "completion_tokens": chunks, "total_tokens": 12 + chunks}
        base = {"id": "cmpl-standin", "created": 1700000000, "model": model}
        text = "tok " * chunks
        self.json = {
            "chat": _response(200, json.dumps({
                **base, "object": "chat.completion",
                "choices": [{"index": 0, "finish_reason": "length",
                             "message": {"role": "assistant", "content": text}}],
                "usage": usage}).encode()),
            "completions": _response(200, json.dumps({
                **base, "object": "text_completion",
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "usage": usage}).encode()),
            "responses": _response(200, json.dumps({
                "id": "resp_standin", "object": "response", "created_at": 1700000000,
                "model": model, "status": "completed",
                "output": [{"type": "message", "id": "msg_standin", "role": "assistant",
                            "status": "completed", "content": [
                                {"type": "output_text", "text": text, "annotations": []}]}],
                "usage": {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": chunks,
                          "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": 12 + chunks}}).encode()),
        }
        self.stream: dict[tuple[str, bool], list[bytes]] = {}
        for kind in ("chat", "completions"):
            obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

            def event(choice: dict[str, Any] | None, extra: dict[str, Any] | None = None,
                      obj: str = obj) -> bytes:
                d = {**base, "object": obj, "choices": [choice] if choice else [],
                     **(extra or {})}
                return _frame(b"data: " + json.dumps(d).encode() + b"\n\n")

            if kind == "chat":
                body = [event({"index": 0, "delta": {"content": "tok "},
                               "finish_reason": None})] * chunks
                finish = event({"index": 0, "delta": {}, "finish_reason": "length"})
            else:
                body = [event({"index": 0, "text": "tok ", "finish_reason": None})] * chunks
                finish = event({"index": 0, "text": "", "finish_reason": "length"})
            head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
            tail = [_frame(b"data: [DONE]\n\n"), b"0\r\n\r\n"]
            self.stream[(kind, False)] = [head, *body, finish, *tail]
            self.stream[(kind, True)] = [head, *body, finish, event(None, {"usage": usage}),
                                         *tail]
        self.health = _response(200, b"", b"text/plain")
        self.models = _response(200, json.dumps({"object": "list", "data": [
            {"id": model, "object": "model", "owned_by": "stand-in"}]}).encode())
        idle = VllmExposition(model, EngineStats, num_gpu_blocks=1_000_000)
        self.metrics = _response(200, idle.render(), b"text/plain; version=0.0.4")
        self.not_found = _response(404, b'{"error": {"message": "not found"}}')
        self.bad = _response(400, b'{"error": {"message": "bad request"}}')


class StandInProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, answers: Answers) -> None:
        self.answers = answers
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            lowered = head.lower()
            i = lowered.find(b"\r\ncontent-length:")
            if i >= 0:
                j = lowered.find(b"\r\n", i + 2)
                length = int(head[i + 17: j if j >= 0 else len(head)])
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4: end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            self._answer(head, body)
            if b"\r\nconnection: close" in lowered and self.transport is not None:
                self.transport.close()
                return

    def _answer(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        a = self.answers
        line = head[: head.find(b"\r\n")] if b"\r\n" in head else head
        method, _, rest = line.partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0]
        write = self.transport.write
        if method == b"POST" and path == b"/v1/responses":
            write(a.json["responses"])
        elif method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
            kind = "chat" if path == b"/v1/chat/completions" else "completions"
            try:
                req = json.loads(body)
            except ValueError:
                write(a.bad)
                return
            if req.get("stream"):
                usage = bool((req.get("stream_options") or {}).get("include_usage"))
                for piece in a.stream[(kind, usage)]:
                    write(piece)
            else:
                write(a.json[kind])
        elif path == b"/health":
            write(a.health)
        elif path == b"/v1/models":
            write(a.models)
        elif path == b"/metrics":
            write(a.metrics)
        else:
            write(a.not_found)


async def serve(host: str, port: int, model: str, chunks: int) -> asyncio.Server:
    """Start the stand-in; returns the listening server (port 0 picks a free one)."""
    answers = Answers(model, chunks)
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: StandInProtocol(answers), host, port, backlog=1024)


async def _main(args: argparse.Namespace) -> None:
    server = await serve(args.host, args.port, args.model, args.chunks)
    port = server.sockets[0].getsockname()[1]
    print(f"stand-in listening on http://{args.host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.stand_in", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--model", default="stand-in")
    p.add_argument("--chunks", type=int, default=64, help="content chunks per streamed answer")
    args = p.parse_args(argv)
    try:
        import uvloop

        uvloop.run(_main(args))
    except ImportError:
        asyncio.run(_main(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
