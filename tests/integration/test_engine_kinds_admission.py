"""Engines without KV-cache usage admitted by the gateway's own observations, through
``sluice serve``: a TGI-dialect simulator (running/waiting only) whose learned limit
rises above the fixed starting point of 4 while it is fast and falls when it is slowed
at run time (``POST /sim/speed``), still serving; and a llama.cpp-dialect simulator
whose reported slots (``GET /props`` ``total_slots``) cap this gateway's requests on it;
and the learned limit of a TGI-dialect simulator serving non-streamed requests only
(answers that come whole: no TTFT or TPOT of their own) rising all the same."""

from __future__ import annotations

import asyncio

import aiohttp
import psutil
import pytest

from tests.integration.limits_support import auth, chat, gateways, sim_engine, tenant, write_config
from tests.support import scrape, wait_for

# Closed-loop clients against simulators that run on the wall clock: how high the
# limit climbs depends on the CPU the machine leaves them (on a loaded 2-core machine
# the measured TPOT includes the clients' and the gateway's CPU), hence ``load``.
pytestmark = [pytest.mark.timeout(240), pytest.mark.load]

FAST = 4.0  # simulator speed factor
SLOW = 1.4  # the speed factor the TGI-dialect engine is slowed to
SLOTS = 3  # the llama.cpp-dialect engine's --max-num-seqs, reported as total_slots
START = 4  # saturation.unmetered_max_in_flight (shipped): where a learned limit starts
# TPOT target 40 ms: the knee (44 + 4 b) / speed ≤ 40 ms is ~29 at speed 4 and 3 at
# SLOW (tests/integration/test_adaptive.py, same profile). SLOW still lets one request
# alone meet the target (34 ms): slower, the engine is served at best effort and has
# no learned limit to fall (whether the fallback limiter's fall or the refitted model
# shows first would be a race). The
# TTFT target and queue wait are long enough that the slowed engine's backlog is served,
# not shed: the test is about admission, not overload.
SLO = {"ttft_s": 120.0, "tpot_s": 0.04}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory):
    engines = [{**sim_engine("t", model="tgi-model", speed=FAST), "dialect": "tgi"},
               {**sim_engine("l", model="llama-model", speed=FAST,
                             args=["--max-num-seqs", str(SLOTS)]), "dialect": "llamacpp"},
               {**sim_engine("w", model="whole-model", speed=FAST), "dialect": "tgi"}]
    cfg = write_config(
        tmp_path_factory.mktemp("unmetered"), tenants=[tenant("t")], engines=engines,
        gateway={"slo": {"interactive": SLO, "standard": SLO, "batch": SLO},
                 "queue": {"default_max_wait_s": 300}})
    with gateways(cfg, 1) as (gw,):
        yield gw



def gauge(m: dict[str, float], name: str, engine: str, model: str) -> float:
    return m.get(f'{name}{{engine="{engine}",model="{model}"}}', -1.0)


async def test_limit_follows_observations_and_never_starves(gateway) -> None:
    urls = {}  # simulator URL by model, from the supervisor's process tree
    for child in psutil.Process(gateway.proc.pid).children(recursive=True):
        cmd = child.cmdline()
        if "loadtest.sim_engine" in cmd:
            urls[cmd[cmd.index("--model") + 1]] = \
                f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    assert set(urls) == {"tgi-model", "llama-model", "whole-model"}, urls
    done: dict[str, int] = {"tgi-model": 0, "llama-model": 0}
    errors: list[int] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def slots_read() -> bool:  # the gateway has read the llama engine's slots
            m = await scrape(session, gateway.url)
            return 0 <= gauge(m, "sluice_engine_concurrency_limit", "l", "llama-model") <= SLOTS

        # until /props answers, the learned limit (4) is all the gateway knows; the
        # slots cap it from the first read on, which is what the samples below check
        await wait_for(slots_read, 30, "the llama engine's slots", poll_s=0.2)

        async def client(i: int, model: str) -> None:
            while True:
                body = chat(f"{i} the river runs to the sea", 24, stream=True, model=model)
                async with session.post(gateway.url + "/v1/chat/completions", json=body,
                                        headers=auth("t")) as r:
                    await r.read()
                    if r.status == 200:
                        done[model] += 1
                    else:
                        errors.append(r.status)

        workers = [asyncio.create_task(client(i, "tgi-model")) for i in range(24)]
        workers += [asyncio.create_task(client(i, "llama-model")) for i in range(8)]
        try:
            seen = {"limit": 0.0, "in_flight": 0.0, "llama_in_flight": 0.0,
                    "llama_limit": 0.0}

            async def sample() -> dict[str, float]:
                m = await scrape(session, gateway.url)
                now = {
                    "limit": gauge(m, "sluice_engine_concurrency_limit", "t", "tgi-model"),
                    "in_flight": gauge(m, "sluice_engine_requests_in_flight", "t",
                                       "tgi-model"),
                    "llama_limit": gauge(m, "sluice_engine_concurrency_limit", "l",
                                         "llama-model"),
                    "llama_in_flight": gauge(m, "sluice_engine_requests_in_flight", "l",
                                             "llama-model")}
                assert now["llama_in_flight"] <= SLOTS, now  # the slots are a hard cap
                assert now["llama_limit"] <= SLOTS, now
                seen.update({k: max(seen[k], v) for k, v in now.items()})
                return now

            async def rose() -> bool:
                await sample()
                # above the starting point (what this test is about); how far above
                # depends on the CPU the loaded machine leaves the simulator (a quiet
                # run reaches ~9, the knee of the simulated engine alone is ~29)
                return seen["limit"] > START and seen["in_flight"] > START \
                    and seen["llama_in_flight"] == SLOTS

            await wait_for(rose, 90, "the learned limit to rise above its start and be used",
                           poll_s=0.1)
            high = seen["limit"]
            print(f"rose after {done}: {seen}")
            async with session.post(urls["tgi-model"] + "/sim/speed", json={"speed": SLOW}) as r:
                assert r.status == 200
            slowed_at = done["tgi-model"]

            low = high

            async def fell() -> bool:
                nonlocal low
                low = (await sample())["limit"]
                return 1 <= low < START

            await wait_for(fell, 120, f"the limit to fall from {high}", poll_s=0.2)
            served = done["tgi-model"]
            # never starved: the slowed engine keeps serving at its lower limit
            await wait_for(lambda: done["tgi-model"] >= served + 5, 60,
                           "the slowed engine to keep serving")
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
    assert not errors, errors
    assert done["tgi-model"] > slowed_at and done["llama-model"] > 0
    print(f"limit rose to {high}, fell to {low}; served {done}")


async def test_limit_rises_on_whole_answers(gateway) -> None:
    """Non-streaming clients only, on an engine without latency histograms: the
    fallback limiter reads each answer's time per output token, so the limit leaves
    its starting point of 4 and is used."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        statuses: list[int] = []
        completion_tokens: list[int] = []

        async def client(i: int) -> None:
            while True:
                body = chat(f"{i} the river runs to the sea", 24, model="whole-model")
                async with session.post(gateway.url + "/v1/chat/completions", json=body,
                                        headers=auth("t")) as r:
                    statuses.append(r.status)
                    if r.status == 200:
                        completion_tokens.append((await r.json())["usage"]["completion_tokens"])

        workers = [asyncio.create_task(client(i)) for i in range(16)]
        seen = {"limit": 0.0, "in_flight": 0.0}
        try:
            async def rose() -> bool:
                m = await scrape(session, gateway.url)
                for k, name in (("limit", "sluice_engine_concurrency_limit"),
                                ("in_flight", "sluice_engine_requests_in_flight")):
                    seen[k] = max(seen[k], gauge(m, name, "w", "whole-model"))
                return seen["limit"] > START and seen["in_flight"] > START

            await wait_for(rose, 90, "the limit to rise above its start and be used",
                           poll_s=0.1)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
    assert statuses and set(statuses) == {200}, statuses
    assert min(completion_tokens) > 0
