"""With ``sluice serve --workers N``, worker 0 launches the engines and the other
workers route to them too. When ``engines.yaml`` drops an engine, worker 0 must not
stop it while another worker's requests still run there (issue 39 item 16: a reload
drains in every mode). Worker 0 sees those requests only in the engine's own report
(``num_requests_running``/``waiting``): here a stream sent straight to the launched
simulator stands for another worker's request (this supervisor's pool never counted
it), and the engine is stopped only after it ended whole."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from config.schema import EnginesConfig
from engines.pool import EnginePool, EngineState
from engines.supervisor import Supervisor, wait_for
from tests.integration.limits_support import FAST_SUPERVISOR, sim_engine

pytestmark = pytest.mark.timeout(120)
TOKENS = 400  # ~2 s at speed 10


async def other_workers_stream(session: aiohttp.ClientSession, base_url: str,
                               started: asyncio.Event) -> tuple[int, int, bool]:
    async with session.post(base_url + "/v1/chat/completions", json={
            "model": "sim-model", "max_tokens": TOKENS, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "hi"}]}) as r:
        body = b""
        try:
            async for chunk in r.content.iter_any():
                started.set()
                body += chunk
        except aiohttp.ClientPayloadError:  # the engine was stopped under it
            pass
    events = [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e.startswith(b"data: ")]
    usage = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")]
    return r.status, usage[-1]["completion_tokens"] if usage else 0, events[-1:] == [b"[DONE]"]


@pytest.mark.parametrize("workers", [False, True], ids=["one-process", "workers"])
async def test_a_removed_engine_waits_for_requests_the_engine_reports(
        workers: bool, tmp_path: Path) -> None:
    specs = [sim_engine("keep", speed=10.0), sim_engine("gone", speed=10.0)]
    # a stopped engine gets 0.5 s after SIGTERM (the simulator, like vLLM's server,
    # finishes its streams on SIGTERM), less than the stream's ~2 s
    cfg = EnginesConfig.model_validate({"engines": specs,
                                        "supervisor": {**FAST_SUPERVISOR, "stop_grace_s": 0.5}})
    pool = EnginePool()
    async with aiohttp.ClientSession() as session:
        sup = Supervisor(cfg, pool, session, run_dir=tmp_path,
                         address_file=tmp_path / "engines.json" if workers else None)
        await sup.start()
        try:
            assert await sup.wait_ready(60)
            gone = pool.get("gone")
            started = asyncio.Event()
            stream = asyncio.create_task(other_workers_stream(session, gone.base_url, started))
            await asyncio.wait_for(started.wait(), 30)
            sup.reconfigure([cfg.engines[0]], grace_s=30)
            assert gone.state is EngineState.DRAINING and gone.in_flight == 0
            status, tokens, done = await asyncio.wait_for(stream, 60)
            if workers:  # the engine's owner waited for it
                assert (status, tokens, done) == (200, TOKENS, True)
            else:  # one process: requests the gateway did not send are not its to wait for
                assert status == 200 and not done
            assert await wait_for(pool, lambda: gone not in pool.engines, 30)
        finally:
            await sup.stop(grace_s=0)
