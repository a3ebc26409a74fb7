"""One measured OpenAI request: TTFT, TPOT and tokens from a streamed answer.

Definitions (as in vLLM's ``benchmarks/benchmark_serving.py``): TTFT is the time
from sending to the first chunk carrying generated text; TPOT is (end − first
token) / (output tokens − 1); E2E is the whole request.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np


@dataclass
class Measured:
    """One request's result. Times in seconds; ``None`` when not applicable.
    ``chunk_at``: ``time.perf_counter()`` at each streamed content chunk, s."""

    status: int
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error_code: str | None = None
    engine: str | None = None
    queue_ms: float | None = None
    headers: dict[str, str] = field(default_factory=dict)
    chunk_at: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error_code is None


async def send_measured(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                        headers: dict[str, str] | None = None,
                        timeout_s: float = 600.0) -> Measured:
    """POST ``body`` (streamed if ``body["stream"]``) and measure it; never raises
    for HTTP or connection errors (they come back as ``status``/``error_code``)."""
    start = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] | None = None
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            m = Measured(status=r.status, engine=r.headers.get("x-sluice-engine"),
                         headers=dict(r.headers))
            if "x-sluice-queue-ms" in r.headers:
                m.queue_ms = float(r.headers["x-sluice-queue-ms"])
            if r.status != 200:
                try:
                    m.error_code = (await r.json(content_type=None))["error"]["code"]
                except (ValueError, KeyError, TypeError, aiohttp.ClientError):
                    m.error_code = f"http_{r.status}"
                m.e2e_s = time.perf_counter() - start
                return m
            if not body.get("stream"):
                data = await r.json()
                m.e2e_s = time.perf_counter() - start
                m.ttft_s = m.e2e_s
                usage = data.get("usage") or {}
                m.prompt_tokens = usage.get("prompt_tokens", 0)
                m.completion_tokens = usage.get("completion_tokens", 0)
                return m
            buf = b""
            async for piece in r.content.iter_any():
                buf += piece
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    obj = json.loads(event[6:])
                    if "error" in obj:
                        m.error_code = obj["error"].get("code") or "stream_error"
                        continue
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for c in obj.get("choices") or ():
                        if (c.get("delta") or {}).get("content") or c.get("text"):
                            m.chunk_at.append(time.perf_counter())
                            if first is None:
                                first = m.chunk_at[0]
    except (aiohttp.ClientError, TimeoutError) as e:
        return Measured(status=0, error_code=type(e).__name__, e2e_s=time.perf_counter() - start)
    end = time.perf_counter()
    m.e2e_s = end - start
    m.prompt_tokens = (usage or {}).get("prompt_tokens", 0)
    m.completion_tokens = (usage or {}).get("completion_tokens", len(m.chunk_at))
    if first is not None:
        m.ttft_s = first - start
        if m.completion_tokens > 1:
            m.tpot_s = (end - first) / (m.completion_tokens - 1)
    return m


def percentile_ms(values: list[float | None], q: float) -> float | None:
    """The ``q``-th percentile (0–100) of the non-None values, in ms."""
    xs = [v for v in values if v is not None]
    return round(float(np.percentile(xs, q)) * 1000, 2) if xs else None


async def wait_healthy(session: aiohttp.ClientSession, url: str, timeout_s: float = 60.0) -> None:
    """Poll ``url/health`` every 0.2 s until it answers 200.

    Raises:
        TimeoutError: not healthy within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy after {timeout_s} s")
        await asyncio.sleep(0.2)
