"""Adaptive admission through ``sluice serve`` with two simulated engines of different
speeds: the learned concurrency limits differ and order as the speeds do; after both
engines are slowed at run time (``POST /sim/speed``) the limits fall, and the engine
now too slow for the TPOT target even alone is served at best effort; the band is
forwarded as vLLM's ``priority`` only to the engine configured with
``--scheduling-policy priority``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import aiohttp
import psutil
import pytest

from tests.integration.limits_support import (
    auth,
    chat,
    gateways,
    sim_engine,
    tenant,
    write_config,
)
from tests.support import scrape, wait_for

# load: closed-loop traffic until the latency models are learned
pytestmark = [pytest.mark.timeout(240), pytest.mark.load]

SLOW, FAST = 1.0, 2.0  # simulator speed factors
# TPOT target 80 ms: knees (44 + 4 b) / speed ≤ 80 ms → about 9 (slow) and 29 (fast),
# less for the prefill interference. Slowed by half: the slow engine's TPOT alone,
# 96 ms, misses the target (best effort); the fast one's knee falls to about 9.
# (Engines this slow keep the streams' chunk rate low enough that the gateway's and
# the clients' CPU on a 2-core machine does not set the measured TPOT.)
SLO = {"ttft_s": 5.0, "tpot_s": 0.08}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory):
    cfg = write_config(
        tmp_path_factory.mktemp("adaptive"),
        tenants=[tenant("chat", priority="interactive"), tenant("bulk", priority="batch")],
        engines=[sim_engine("slow", speed=SLOW),
                 sim_engine("fast", speed=FAST, args=["--scheduling-policy", "priority",
                                                      "--enable-prompt-tokens-details"])],
        gateway={"slo": {"interactive": SLO, "standard": SLO, "batch": SLO},
                 "queue": {"default_max_wait_s": 30}},
        saturation={"max_waiting": 1000, "adaptive": {"min_samples": 10}},
    )
    with gateways(cfg, 1) as (gw,):
        yield gw


def engine_urls(gw) -> dict[float, str]:
    """Simulator URL by its ``--speed``."""
    out = {}
    for child in psutil.Process(gw.proc.pid).children(recursive=True):
        cmd = child.cmdline()
        if "loadtest.sim_engine" in cmd:
            out[float(cmd[cmd.index("--speed") + 1])] = \
                f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    return out



def limit(m: dict[str, float], engine: str) -> float | None:
    return m.get(f'sluice_engine_concurrency_limit{{engine="{engine}",model="sim-model"}}')


def mode(m: dict[str, float], engine: str) -> str | None:
    for k in ("model", "gradient", "best_effort"):
        if m.get(f'sluice_engine_admission_mode{{engine="{engine}",mode="{k}",model="sim-model"}}'):
            return k
    return None



async def test_learned_limits_order_with_speed_fall_when_slowed_and_priority_is_forwarded(
        gateway) -> None:
    statuses: dict[int, int] = {}
    go = asyncio.Event()  # cleared: the clients send nothing new (the models freeze)
    go.set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client(i: int) -> None:
            name = "chat" if i % 2 else "bulk"
            words = "the river runs to the sea and the sea is never full " * (1 + i % 4)
            while True:
                await go.wait()
                body = chat(f"{i} {words}", 24, stream=True)
                async with session.post(gateway.url + "/v1/chat/completions", json=body,
                                        headers=auth(name)) as r:
                    await r.read()
                    statuses[r.status] = statuses.get(r.status, 0) + 1

        workers = [asyncio.create_task(client(i)) for i in range(40)]
        try:
            seen: dict[str, float] = {}

            def ordered(m: dict[str, float]) -> bool:
                seen.update({e: limit(m, e) or 0 for e in ("slow", "fast")})
                return all(mode(m, e) == "model" for e in ("slow", "fast")) \
                    and 1 < seen["slow"] < seen["fast"]

            async def learned() -> bool:
                return ordered(await scrape(session, gateway.url))

            async def idle() -> bool:
                m = await scrape(session, gateway.url)
                return sum(v for k, v in m.items()
                           if k.startswith("sluice_engine_requests_in_flight{")) == 0

            fitted: tuple[float, dict[str, float]] = (0.0, {})

            async def settled() -> bool:
                """The fitted models unchanged over at least two metrics scrapes (0.25 s
                apart): the engines' histograms of the last requests, read at the next
                scrape after they end, have reached them."""
                nonlocal fitted
                m = await scrape(session, gateway.url)
                now = {k: v for k, v in m.items() if k.startswith(
                    ("sluice_engine_latency_param{", "sluice_engine_concurrency_limit{"))}
                at, before = fitted
                if time.monotonic() - at < 0.5:
                    return False
                fitted = (time.monotonic(), now)
                return now == before

            # learned under load, then read with the clients paused and nothing in
            # flight, so the gauge and the capacity report see the same fitted models
            for _ in range(5):
                await wait_for(learned, 90, "learned limits ordered as the speeds", poll_s=0.25)
                go.clear()
                await wait_for(idle, 30, "the requests in flight to finish")
                await wait_for(settled, 30, "the fitted models to settle", poll_s=0.6)
                if ordered(await scrape(session, gateway.url)):
                    break
                go.set()
            else:
                pytest.fail(f"the limits did not stay ordered once the load paused: {seen}")
            before = dict(seen)
            m = await scrape(session, gateway.url)
            assert m['sluice_predicted_ttft_error_count{engine="fast",model="sim-model"}'] > 0
            assert m['sluice_engine_latency_param{engine="slow",model="sim-model",'
                     'param="step_s_per_seq"}'] > 0
            # the capacity report agrees, through the CLI
            out = subprocess.run(
                [sys.executable, "-m", "gateway.cli", "capacity", "--url", gateway.url,
                 "--rate", "20", "--json"], capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
            (report,) = json.loads(out.stdout)["models"]
            knee = {e["engine"]: e["bands"]["interactive"] for e in report["engines"]}
            assert knee["slow"]["knee"] == before["slow"] and knee["fast"]["knee"] == before["fast"]
            assert knee["slow"]["requests_per_s"] < knee["fast"]["requests_per_s"]
            fleet = report["fleet"]["by_kind"]
            assert fleet["slow"]["engines"] > fleet["fast"]["engines"] >= 1
            go.set()
            urls = engine_urls(gateway)
            for speed, url in urls.items():  # both engines at half their speed
                async with session.post(url + "/sim/speed", json={"speed": speed / 2}) as r:
                    assert r.status == 200 and (await r.json())["speed"] == speed / 2

            async def fell() -> bool:
                m = await scrape(session, gateway.url)
                seen.update({e: limit(m, e) or 0 for e in ("slow", "fast")})
                # best effort: no learned limit (and the simulator reports no slots)
                return mode(m, "slow") == "best_effort" and limit(m, "slow") is None \
                    and mode(m, "fast") == "model" and seen["fast"] < before["fast"] / 2

            await wait_for(fell, 90, f"the fast limit to fall from {before} and the slow "
                           "engine to best effort", poll_s=0.25)

            async def slow_served() -> int:
                m = await scrape(session, urls[SLOW])
                return sum(v for k, v in m.items()
                           if k.startswith("vllm:time_to_first_token_seconds_count"))

            served = await slow_served()

            async def still_served() -> bool:
                return await slow_served() >= served + 5

            await wait_for(still_served, 60, "the best-effort engine to keep serving")
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

        # with no load, a few batch requests (under load the batch band may have
        # yielded the fast engine's places to the interactive one throughout)
        async def bulk(i: int) -> int:
            async with session.post(gateway.url + "/v1/chat/completions",
                                    json=chat(f"probe {i}", 4), headers=auth("bulk")) as r:
                await r.read()
                return r.status

        assert await asyncio.gather(*(bulk(i) for i in range(4))) == [200] * 4
        # the band went to the priority-scheduling engine (batch = 2, interactive = 0)
        # and never to the other, which would have answered 400
        slow_m = await scrape(session, urls[SLOW])
        fast_m = await scrape(session, urls[FAST])
        prio = "sim:requests_by_priority_total{{priority=\"{}\"}}"
        assert fast_m.get(prio.format(2), 0) > 0 and fast_m.get(prio.format(0), 0) > 0
        assert slow_m.get(prio.format(0), 0) > 0
        assert not any(k.startswith("sim:requests_by_priority_total") and '"0"' not in k
                       for k in slow_m)
        assert statuses.get(400, 0) == 0 and statuses.get(500, 0) == 0, statuses
        assert statuses.get(200, 0) > 20, statuses
        print(f"limits learned {before}, after slowing {seen}; statuses {statuses}")
