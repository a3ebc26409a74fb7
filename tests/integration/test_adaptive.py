"""Adaptive admission through ``sluice serve`` with two simulated engines of different
speeds: the learned concurrency limits differ and order as the speeds do; after both
engines are slowed at run time (``POST /sim/speed``) the limits fall; the band is
forwarded as vLLM's ``priority`` only to the engine configured with
``--scheduling-policy priority``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

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

pytestmark = pytest.mark.timeout(240)

SLOW, FAST = 2.0, 4.0  # simulator speed factors
# TPOT target 40 ms: knees (44 + 4 b) / speed ≤ 40 ms → about 9 (slow) and 29 (fast)
SLO = {"ttft_s": 5.0, "tpot_s": 0.04}


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
    for k in ("model", "gradient"):
        if m.get(f'sluice_engine_admission_mode{{engine="{engine}",mode="{k}",model="sim-model"}}'):
            return k
    return None



async def test_learned_limits_order_with_speed_fall_when_slowed_and_priority_is_forwarded(
        gateway) -> None:
    statuses: dict[int, int] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client(i: int) -> None:
            name = "chat" if i % 2 else "bulk"
            words = "the river runs to the sea and the sea is never full " * (1 + i % 4)
            while True:
                body = chat(f"{i} {words}", 24, stream=True)
                async with session.post(gateway.url + "/v1/chat/completions", json=body,
                                        headers=auth(name)) as r:
                    await r.read()
                    statuses[r.status] = statuses.get(r.status, 0) + 1

        workers = [asyncio.create_task(client(i)) for i in range(40)]
        try:
            seen: dict[str, float] = {}

            async def learned() -> bool:
                m = await scrape(session, gateway.url)
                seen.update({e: limit(m, e) or 0 for e in ("slow", "fast")})
                return all(mode(m, e) == "model" for e in ("slow", "fast")) \
                    and 1 < seen["slow"] < seen["fast"]

            await wait_for(learned, 90, "learned limits ordered as the speeds", poll_s=0.25)
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
            assert knee["slow"]["knee"] < knee["fast"]["knee"]
            assert knee["slow"]["requests_per_s"] < knee["fast"]["requests_per_s"]
            fleet = report["fleet"]["by_kind"]
            assert fleet["slow"]["engines"] > fleet["fast"]["engines"] >= 1
            urls = engine_urls(gateway)
            for speed, url in urls.items():  # both engines at a third of their speed
                async with session.post(url + "/sim/speed", json={"speed": speed / 3}) as r:
                    assert r.status == 200 and (await r.json())["speed"] == speed / 3

            async def fell() -> bool:
                m = await scrape(session, gateway.url)
                seen.update({e: limit(m, e) or 0 for e in ("slow", "fast")})
                return seen["slow"] < before["slow"] and seen["fast"] < before["fast"] / 2

            await wait_for(fell, 90, f"limits to fall from {before}", poll_s=0.25)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

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
        assert statuses.get(200, 0) > 40, statuses
        print(f"limits learned {before}, after slowing {seen}; statuses {statuses}")
