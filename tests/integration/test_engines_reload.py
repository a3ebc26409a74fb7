"""``engines.yaml`` reloaded while the gateway serves: engines added by editing the file
take requests once healthy; removed ones drain (a streamed request on one finishes
whole, new requests go elsewhere) and are then stopped (launched) or forgotten
(``external``), with their KV-event subscriber and metric series; a changed
definition drains the old engine and starts the new one; a model that disappears
answers 404; an invalid file keeps the running fleet. Real HTTP, simulated engines
(``kind: sim`` launched by the gateway, ``python -m loadtest.sim_engine`` processes
as ``kind: external``)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import yaml

from config.loader import load_config
from engines.pool import EngineState
from gateway.keys import DIRECTOR, RELOADER, SCHEDULER, SLO_GATE, SUPERVISOR
from tests.conftest import free_port
from tests.integration.conftest import FAST_SUPERVISOR, run_gateway
from tests.support import wait_for, wait_for_sync

pytestmark = pytest.mark.timeout(120)

MODEL = "sim-model"


def sim(name: str, model: str = MODEL, speed: float = 4.0) -> dict[str, Any]:
    """A launched simulated engine (``kind: sim``)."""
    return {"name": name, "model": model, "kind": "sim", "args": ["--speed", str(speed)]}


def external(name: str, url: str, model: str = MODEL) -> dict[str, Any]:
    return {"name": name, "model": model, "kind": "external", "url": url}


def write_engines(directory: Path, engines: list[dict[str, Any]], **sections: Any) -> None:
    """Replace ``engines.yaml`` as an editor's save does (write aside, rename)."""
    body = {"engines": engines, "supervisor": FAST_SUPERVISOR, **sections}
    tmp = directory / ".engines.yaml.new"
    tmp.write_text(yaml.safe_dump(body))
    os.replace(tmp, directory / "engines.yaml")


def config_dir(tmp_path: Path, engines: list[dict[str, Any]],
               tenants: dict[str, Any] | None = None, **sections: Any) -> Path:
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump({
        "port": 0, "drain_grace_s": 60, "cache": {"enabled": False},
        "observability": {"access_log": False, "tracing": False}}))
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump(tenants or {"allow_anonymous": True}))
    write_engines(tmp_path, engines, **sections)
    return tmp_path


def body(model: str = MODEL, max_tokens: int = 4, stream: bool = False,
         content: str = "hello there") -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "max_tokens": max_tokens,
                           "messages": [{"role": "user", "content": content}]}
    if stream:
        out.update(stream=True, stream_options={"include_usage": True})
    return out


def reloaded(reloader: Any, n: int, result: str = "ok") -> Any:
    """Predicate: more than ``n`` reloads were recorded and the last had ``result``."""
    return lambda: len(reloader.history) > n and reloader.history[-1].result == result


async def models(gw: Any) -> list[str]:
    async with gw.session.get(gw.url + "/v1/models") as r:
        return [m["id"] for m in (await r.json())["data"]]


async def metrics_text(gw: Any) -> str:
    async with gw.session.get(gw.url + "/metrics") as r:
        return await r.text()


@pytest.fixture
def sim_servers() -> Iterator[Any]:
    """Start ``python -m loadtest.sim_engine`` processes (the test's own, routed to as
    ``kind: external``); returns their base URLs; stops them at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*speeds: float) -> list[str]:
        urls = []
        for speed in speeds:
            port = free_port()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "loadtest.sim_engine", "--port", str(port),
                 "--model", MODEL, "--speed", str(speed)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(procs[-len(urls):], urls, strict=True):
            def up(url: str = url, proc: subprocess.Popen[bytes] = proc) -> bool:
                assert proc.poll() is None, "simulator exited"
                try:
                    return httpx.get(url + "/health", timeout=1).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_for_sync(up, 60, f"the simulator at {url}")
        return urls

    yield start
    for proc in procs:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


async def test_engines_added_changed_and_removed_by_editing_the_file(tmp_path: Path) -> None:
    """Launched engines with KV events: an added engine (new model) is started and
    serves once healthy, with its own KV-event subscriber; a changed definition
    replaces the process under the same id; a removed engine's process is stopped,
    its model answers 404 and its series leave ``/metrics``."""
    events = {"scheduler": {"prefix": {"source": "events"}}}
    directory = config_dir(tmp_path, [sim("a")], **events)
    async with run_gateway(load_config(directory=directory)) as gw:
        reloader, sup = gw.app[RELOADER], gw.app[SUPERVISOR]
        r = await gw.post("/v1/chat/completions", body("other-model"))
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"

        write_engines(directory, [sim("a"), sim("b", model="other-model")], **events)
        await wait_for(reloaded(reloader, 0), 10, "the reload")
        b = gw.pool.get("b")
        assert b is not None and b.state is EngineState.STARTING  # no traffic yet
        await wait_for(lambda: b.routable, 60, "b healthy")
        assert await models(gw) == [MODEL, "other-model"]
        r = await gw.post("/v1/chat/completions", body("other-model"))
        assert r.status == 200 and r.headers["x-sluice-engine"] == "b", await r.text()
        assert 'sluice_engine_kv_events_synced{engine="b"' in await metrics_text(gw)
        index = gw.app[SCHEDULER].index

        first = next(x for x in sup.runners if x.engine is b).process
        write_engines(directory, [sim("a"), {**sim("b", model="other-model"), "args": [
            "--speed", "8"]}], **events)  # a changed definition
        await wait_for(reloaded(reloader, 1), 10, "the second reload")
        await wait_for(lambda: gw.pool.get("b") not in (None, b)
                       and gw.pool.get("b").routable, 60, "the new b healthy")
        assert first.returncode is not None  # the old process was stopped first
        assert "--speed 8" in " ".join(sup.runners[-1].process.argv)
        long = body("other-model", content="a long prompt " * 200)  # 600 tokens: 4 blocks
        r = await gw.post("/v1/chat/completions", long)
        assert r.status == 200 and r.headers["x-sluice-engine"] == "b"
        b = gw.pool.get("b")
        await wait_for(lambda: index.entries("b") > 0, 10, "b's reported blocks")
        assert index.approximate.entries("b") > 0

        second = sup.runners[-1].process
        write_engines(directory, [sim("a")], **events)
        await wait_for(reloaded(reloader, 2), 10, "the third reload")
        assert await models(gw) == [MODEL]  # draining: gone from the list at once
        r = await gw.post("/v1/chat/completions", body("other-model"))
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        await wait_for(lambda: gw.pool.get("b") is None, 30, "b retired")
        assert second.returncode is not None
        assert index.entries("b") == index.approximate.entries("b") == 0
        assert index.predicted.entries("b") == 0 and not gw.app[SLO_GATE].tracks("b")
        assert [x.engine.id for x in sup.runners] == ["a"]
        text = await metrics_text(gw)
        assert 'engine="b"' not in text
        assert 'sluice_config_reloads_total{result="ok"} 3.0' in text
        assert (await gw.post("/v1/chat/completions", body())).status == 200


async def test_removed_engine_finishes_its_stream_then_is_forgotten(
        tmp_path: Path, sim_servers: Any) -> None:
    """An external engine removed while it streams: it is draining at once, new
    requests go to the engine that replaced it, the stream ends whole, and then the
    engine leaves the pool (its server is left running: the gateway does not own
    it)."""
    slow, fast = sim_servers(0.5, 4.0)
    directory = config_dir(tmp_path, [external("a", slow)])
    async with run_gateway(load_config(directory=directory)) as gw:
        reloader = gw.app[RELOADER]
        a = gw.pool.get("a")
        async with gw.session.post(gw.url + "/v1/chat/completions",
                                   json=body(max_tokens=40, stream=True)) as stream:
            assert stream.status == 200 and stream.headers["x-sluice-engine"] == "a"
            first = await stream.content.readline()
            assert first.startswith(b"data: ")

            write_engines(directory, [external("b", fast)])
            await wait_for(reloaded(reloader, 0), 10, "the reload")
            assert a.state is EngineState.DRAINING and a.in_flight == 1
            await gw.wait_ready(1)
            for _ in range(3):
                r = await gw.post("/v1/chat/completions", body())
                assert r.status == 200 and r.headers["x-sluice-engine"] == "b"
            assert gw.pool.get("a") is a and a.in_flight == 1  # still draining

            rest = (first + await stream.read()).decode()
        events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 40  # the whole answer
        await wait_for(lambda: gw.pool.get("a") is None, 10, "a forgotten")
        assert [e.id for e in gw.pool.engines] == ["b"]
        async with aiohttp.ClientSession() as s, s.get(slow + "/health") as r:
            assert r.status == 200  # external: forgotten, not stopped


async def test_an_invalid_edit_keeps_the_running_fleet(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Bad fields, a model a tenant still needs, and a half-written file are each
    refused (logged, counted as ``result="error"``) and the engines keep serving; a
    change to a section that needs a restart is named in a warning."""
    tenants = {"allow_anonymous": True, "tenants": [{"name": "t", "allowed_models": [MODEL]}]}
    directory = config_dir(tmp_path, [sim("a")], tenants=tenants)
    async with run_gateway(load_config(directory=directory)) as gw:
        reloader = gw.app[RELOADER]
        a = gw.pool.get("a")
        bad = [
            ([{"name": "a", "model": MODEL, "kind": "vllm"}], "engines.0"),  # no model_path
            ([sim("a", model="renamed")], "no engine serves this model"),
        ]
        for n, (engines, error) in enumerate(bad):
            write_engines(directory, engines)
            await wait_for(reloaded(reloader, n, "error"), 10, "the refused reload")
            assert error in reloader.history[-1].error
        n = len(reloader.history)
        (directory / "engines.yaml").write_text("")  # mid-rewrite
        await wait_for(reloaded(reloader, n, "error"), 10, "the refused reload")
        assert 'sluice_config_reloads_total{result="error"} 3.0' in await metrics_text(gw)
        assert gw.pool.engines == [a] and a.routable
        assert (await gw.post("/v1/chat/completions", body())).status == 200

        n = len(reloader.history)
        with caplog.at_level(logging.WARNING, logger="sluice.app"):
            write_engines(directory, [sim("a")],
                          supervisor={**FAST_SUPERVISOR, "probe_timeout_s": 3.0},
                          saturation={"max_waiting": 2})
            await wait_for(reloaded(reloader, n), 10, "the reload")
        assert "supervisor changed; these take effect on a restart" in caplog.text
        assert gw.pool.engines == [a]  # the same engine, untouched
        assert gw.app[SUPERVISOR].cfg.supervisor.probe_timeout_s == FAST_SUPERVISOR[
            "probe_timeout_s"]
        assert gw.app[DIRECTOR].placer.detector.max_waiting == 2  # applied
