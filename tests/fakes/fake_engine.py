"""A tiny stand-in for a vLLM OpenAI server, for supervisor tests over loopback.

Serves ``/health``, ``/v1/models``, ``/v1/completions`` (one token) and a vLLM-style
``/metrics`` (the shared writer, :mod:`loadtest.sim_engine.metrics`). Flags shape its
behaviour: slow start-up, exiting on its own, failing health while a file exists,
ignoring SIGTERM, and spawning a grandchild (like vLLM's EngineCore) whose pid it
writes to a file.

Run from the repository root: ``python -m tests.fakes.fake_engine --host H --port P
--model M [flags]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from aiohttp import web

from loadtest.sim_engine.metrics import EngineStats, VllmExposition


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--startup-delay", type=float, default=0.0, help="s before listening")
    p.add_argument("--exit-after", type=float, default=None, help="exit(3) after s")
    p.add_argument("--health-fail-file", type=Path, default=None,
                   help="/health answers 503 while this file exists (and appends a line "
                   "to it per failed answer)")
    p.add_argument("--completion-delay", type=float, default=0.0, help="s per completion")
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--child-pid-file", type=Path, default=None,
                   help="spawn a sleeping grandchild and write its pid here")
    p.add_argument("--pid-file", type=Path, default=None, help="write own pid here")
    return p.parse_args(argv)


def make_app(args: argparse.Namespace) -> web.Application:
    state = {"running": 0, "queries": 0, "generated": 0}

    async def health(_: web.Request) -> web.Response:
        if args.health_fail_file and args.health_fail_file.exists():
            with args.health_fail_file.open("a") as f:
                f.write("503\n")
            return web.Response(status=503)
        return web.Response()

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": args.model}]})

    async def completions(req: web.Request) -> web.Response:
        body = await req.json()
        state["running"] += 1
        state["queries"] += 1
        try:
            await asyncio.sleep(args.completion_delay)
        finally:
            state["running"] -= 1
        return web.json_response({
            "object": "text_completion", "model": body["model"],
            "choices": [{"index": 0, "text": " x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        })

    exposition = VllmExposition(args.model, lambda: EngineStats(
        running=state["running"], kv_cache_usage=0.01 * state["running"],
        prefix_cache_queries=state["queries"], generation_tokens=state["generated"]),
        num_gpu_blocks=100)

    async def metrics(_: web.Request) -> web.Response:
        state["generated"] += state["running"]  # running requests decode between scrapes
        return web.Response(body=exposition.render(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(args: argparse.Namespace) -> None:
    await asyncio.sleep(args.startup_delay)
    runner = web.AppRunner(make_app(args))
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    if args.exit_after is not None:
        await asyncio.sleep(args.exit_after)
        os._exit(3)
    await asyncio.Event().wait()


def main() -> None:
    args = parse(sys.argv[1:])
    if args.pid_file:
        args.pid_file.write_text(str(os.getpid()))
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    if args.child_pid_file:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        args.child_pid_file.write_text(str(child.pid))
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
