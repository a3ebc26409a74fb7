"""loadtest.realprompts: the overload run's arrivals and scoring, the TTFT prediction
error read from the gateway's headers, and the concurrency-8 window's throughput."""

from __future__ import annotations

import pytest

from config.schema import SloConfig
from loadtest.client import Measured
from loadtest.realprompts import arrivals, rel_errors, score, summarize


def test_arrivals_are_poisson_within_the_window_with_the_tenant_shares() -> None:
    plan = arrivals(rate=20.0, duration_s=100.0, n_prompts=7, seed=3)
    assert plan == arrivals(rate=20.0, duration_s=100.0, n_prompts=7, seed=3)
    assert all(0 <= t < 100 for t, _, _ in plan)
    assert len(plan) == pytest.approx(2000, rel=0.1)
    shares = {name: sum(1 for _, n, _ in plan if n == name) / len(plan)
              for name in ("acme", "globex", "initech")}
    assert shares == pytest.approx({"acme": 0.3, "globex": 0.5, "initech": 0.2}, abs=0.04)
    assert {i for _, _, i in plan} == set(range(7))


def test_score_counts_slo_misses_rejections_and_cancellations_per_band() -> None:
    ok = Measured(status=200, ttft_s=0.5, tpot_s=0.05)
    slow_start = Measured(status=200, ttft_s=1.5, tpot_s=0.05)  # interactive: > 1 s
    slow_decode = Measured(status=200, ttft_s=0.5, tpot_s=0.2)
    shed = Measured(status=503, error_code="overloaded")
    results = [("acme", ok), ("acme", slow_start), ("acme", shed), ("acme", None),
               ("globex", slow_start), ("globex", slow_decode), ("initech", ok)]
    s = score(results, SloConfig(), duration_s=10.0)
    assert s["slo_attainment"] == {"interactive": 0.25, "standard": 0.5, "batch": 1.0}
    assert s["goodput"] == pytest.approx(0.3)  # 3 good in 10 s
    assert s["shed"] == {"503:overloaded": 1, "cancelled_at_deadline": 1}
    assert s["offered"] == 7


def test_rel_errors_compare_the_prediction_with_ttft_less_the_queue_wait() -> None:
    def m(ttft: float, queue_ms: float | None, predicted: str | None) -> Measured:
        headers = {} if predicted is None else {"x-sluice-ttft-predicted-ms": predicted}
        return Measured(status=200, ttft_s=ttft, queue_ms=queue_ms, headers=headers)

    errs = rel_errors([m(0.6, 100.0, "400"), m(1.0, None, "1500"), m(1.0, None, None),
                       Measured(status=503, error_code="overloaded")])
    assert errs == pytest.approx([0.2, 0.5])


async def test_run_for_keeps_every_client_busy_and_counts_the_tokens_streamed_in_the_window(
        ) -> None:
    """Closed loop over loopback HTTP: each client sends its next body as soon as its
    answer ends, the bodies cycle, and a stream that outlasts the window counts the
    chunks it streamed within it, not those after (the server holds the first
    request's second chunk past the window)."""
    import asyncio
    import json

    import aiohttp
    from aiohttp import web

    from loadtest.realprompts import _run_for

    seen: list[str] = []
    release = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body["messages"][0]["content"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(2):
            if i == 1 and len(seen) == 1:
                await release.wait()  # the first request's second chunk: after the window
            chunk = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    bodies = [{"model": "m", "stream": True, "messages": [{"role": "user", "content": c}]}
              for c in "abc"]
    try:
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(_run_for(session, f"http://127.0.0.1:{port}"
                                                "/v1/chat/completions", bodies, 2, 0.3))
            done, _ = await asyncio.wait({task}, timeout=0.6)
            assert not done  # the held request keeps the run open past its window
            release.set()
            results, streamed = await task
    finally:
        await runner.cleanup()
    assert seen[:4] == ["a", "b", "c", "a"]  # one sequence, cycled, over both clients
    assert len(results) == len(seen)  # every request sent in the window is waited for
    assert all(r.ok and r.completion_tokens == 2 and len(r.chunk_at) == 2 for r in results)
    # the held request's second chunk came after the window; every other request was
    # answered within it, save perhaps the other client's last one at the window's end
    total = 2 * len(results)
    assert total - 3 <= streamed <= total - 1


def test_summarize_rates_a_window_by_its_streamed_tokens() -> None:
    """Given the chunks streamed within the window, throughput is those over its
    length and the request rate that over a served request's mean output tokens
    (errors count in neither); without them, whole answers over the wall time."""
    served = [Measured(status=200, completion_tokens=4), Measured(status=200, completion_tokens=2),
              Measured(status=503, error_code="overloaded")]
    windowed = summarize(served, 10.0, streamed=30)
    assert (windowed["output_tok_s"], windowed["requests_s"], windowed["errors"]) == (3.0, 1.0, 1)
    whole = summarize(served, 2.0)
    assert (whole["output_tok_s"], whole["requests_s"]) == (3.0, 1.0)
