"""The ``/dashboard`` page in real headless Chromium (Debian's ``chromium`` driven by
the ``playwright`` Python package, no browser download).

* ``test_page_matches_contract_feed``: a loopback server serves the same page file and
  a hand-written ``/admin/stats`` document (edge cases: nulls, a tenant name with a
  dot, a reason containing ``:``, every engine state, a failed reload whose error
  text is HTML); every number the page shows equals the document's.
* ``test_page_needs_admin_key``: without a key the page says so; ``#key=`` fixes it.
* ``test_live_dashboard_during_load``: ``sluice serve`` with simulated engines and an
  admin key; a short overload (admitted, cached, 401, 429, 503) and two tenants.yaml
  reloads (one good, one bad) while the page is open; charts are drawn, the page
  matches ``/admin/stats`` fetched at the same moment, and a screenshot is saved
  under the test's ``tmp_path`` (and copied to ``out/dashboard.png``).

Skipped, with the reason, when the ``playwright`` package or a ``chromium`` binary is
missing (``make test`` installs both; chromium only as root) or when
``SLUICE_SKIP_BROWSER`` is set (``make test SKIP_BROWSER=1``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
import yaml
from aiohttp import web

from gateway.auth import hash_key
from gateway.dashboard import dashboard
from tests.integration.limits_support import (
    MODEL,
    auth,
    chat,
    gateways,
    sim_engine,
    tenant,
    write_config,
)
from tests.support import wait_for

try:
    from playwright.async_api import Browser, Page, async_playwright
except ImportError:  # pragma: no cover - reported as a skip reason below
    async_playwright = None  # type: ignore[assignment]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
REPO = Path(__file__).resolve().parents[2]
ADMIN_KEY = "admin-secret-key"

if os.environ.get("SLUICE_SKIP_BROWSER"):
    _SKIP = "browser tests skipped on request (make test SKIP_BROWSER=1)"
elif async_playwright is None:
    _SKIP = "the playwright package is not installed (pip install -e '.[dev]')"
elif CHROMIUM is None:
    _SKIP = ("no chromium on PATH: `make test` installs Debian's chromium only as root with "
             "apt-get (or run `apt-get install chromium`)")
else:
    _SKIP = ""
pytestmark = [pytest.mark.skipif(bool(_SKIP), reason=_SKIP), pytest.mark.timeout(180)]


# --------------------------------------------------------------------------- helpers


@pytest.fixture
async def browser():
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            await b.close()


class Watched:
    """A page plus what it did: requests to other origins, console errors."""

    def __init__(self, page: Page, origin: str) -> None:
        self.page, self.origin = page, origin
        self.foreign: list[str] = []
        self.errors: list[str] = []
        page.on("request", self._request)
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))

    def _request(self, req: Any) -> None:
        u = urlsplit(req.url)
        if u.scheme not in ("data", "about") and f"{u.scheme}://{u.netloc}" != self.origin:
            self.foreign.append(req.url)


async def open_dashboard(browser: Browser, base: str, fragment: str = "") -> Watched:
    page = await browser.new_page(viewport={"width": 1440, "height": 980})
    w = Watched(page, base)
    resp = await page.goto(f"{base}/dashboard{fragment}")
    assert resp is not None and resp.status == 200
    assert "script-src 'sha256-" in resp.headers["content-security-policy"]
    return w


async def wait_updates(page: Page, n: int, timeout_s: float = 15.0) -> None:
    await page.wait_for_function("n => Number(document.body.dataset.updates || 0) >= n",
                                 arg=n, timeout=timeout_s * 1000)


async def updates(page: Page) -> int:
    return int(await page.evaluate("Number(document.body.dataset.updates || 0)"))


async def dom_stats(page: Page) -> list[dict[str, Any]]:
    return await page.eval_on_selector_all(
        "[data-stat]", """els => els.map(e => ({path: JSON.parse(e.dataset.stat),
            value: JSON.parse(e.dataset.value), text: e.textContent}))""")


async def chart_points(page: Page, svg_id: str) -> dict[str, int]:
    return await page.eval_on_selector_all(
        f"#{svg_id} path.series",
        "ps => Object.fromEntries(ps.map(p => [p.dataset.series, Number(p.dataset.points)]))")


_MISSING = object()


def lookup(feed: dict[str, Any], path: list[Any]) -> Any:
    """The feed value at a page path; engines are addressed by id, -1 is the last sample."""
    node: Any = feed
    for part in path:
        if isinstance(node, list) and isinstance(part, str):
            node = next((e for e in node if e.get("id") == part), _MISSING)
        elif isinstance(node, list):
            node = node[part] if -len(node) <= part < len(node) else None
        elif isinstance(node, dict):
            node = node.get(part, _MISSING)
        else:
            return _MISSING
        if node is _MISSING:
            return _MISSING
    return node


def expected_paths(feed: dict[str, Any]) -> set[str]:
    """Every feed value the page must show (as JSON-encoded paths)."""
    paths: list[list[Any]] = []
    for name, t in feed["tenants"].items():
        paths.append(["tenants", name, "admitted"])
        paths += [["tenants", name, "rejected", r] for r in t["rejected"]]
    for e in feed["engines"]:
        paths += [["engines", e["id"], f] for f in
                  ("id", "model", "state", "kv_cache_usage", "running", "waiting", "in_flight",
                   "restarts", "limit", "mode", "output_tokens_per_hour",
                   "cost_per_1k_output_tokens")]
    paths += [["latency", k] for k in feed["latency"]]
    paths += [["cache", k] for k in ("lookups", "hits", "hit_rate")]
    n = len(feed["reloads"])
    for i in range(max(0, n - 20), n):
        paths += [["reloads", i, f] for f in ("at", "result", "path")]
        if feed["reloads"][i]["error"]:
            paths.append(["reloads", i, "error"])
    paths += [["series", "queue_depth", p, -1] for p in feed["series"]["queue_depth"]]
    paths += [["series", "admitted_rps", -1], ["series", "shed_rps", -1]]
    paths += [["series", "engines", e, "limit", -1] for e in feed["series"]["engines"]]
    return {json.dumps(p) for p in paths}


def _number(text: str) -> float:
    return float(text.strip().rstrip("%"))


def text_matches(path: list[Any], value: Any, text: str) -> bool:
    """The shown text is the value in the page's format (ms: 1 decimal below 10,
    else whole; ratios: percent with 1 decimal; req/s: 1 decimal below 10)."""
    if value is None:
        return text == ("none" if "limit" in path else "—")
    if isinstance(value, str):
        return text == value
    if path[0] == "reloads":  # "at" is shown as a clock time
        return True
    if path[-1] in ("hit_rate", "kv_cache_usage"):
        return text.endswith("%") and abs(_number(text) - value * 100) <= 0.05 + 1e-9
    if path[-1] == "cost_per_1k_output_tokens":
        return text == f"{value:.4f}"
    if path[0] == "latency" or path[1:2] in (["admitted_rps"], ["shed_rps"]):
        step = 0.1 if abs(value) < 10 else 1.0
        return abs(_number(text) - value) <= step / 2 + 1e-9
    return text == str(round(value))


def compare(dom: list[dict[str, Any]], feed: dict[str, Any]) -> list[str]:
    """Mismatches between the page and the feed (empty when they agree)."""
    problems = []
    shown = {json.dumps(d["path"]) for d in dom}
    problems += [f"not on the page: {p}" for p in sorted(expected_paths(feed) - shown)]
    for d in dom:
        want = lookup(feed, d["path"])
        if want is _MISSING:
            problems.append(f"on the page but not in the feed: {d['path']}")
        elif d["value"] != want:
            problems.append(f"{d['path']}: page {d['value']!r} feed {want!r}")
        elif not text_matches(d["path"], want, d["text"]):
            problems.append(f"{d['path']}: text {d['text']!r} for {want!r}")
    return problems


# --------------------------------------------------------------------------- contract feed


def contract_feed(now: float) -> dict[str, Any]:
    t = [now - 299 + i for i in range(300)]
    wave = [round(40 * abs(math.sin(i / 25))) for i in range(300)]
    return {
        "now": now, "interval_s": 1.0,
        "series": {"t": t,
                   "queue_depth": {"interactive": [w // 8 for w in wave], "standard": wave,
                                   "batch": [min(64, 2 * w) for w in wave]},
                   "admitted_rps": [12.5 + (i % 7) for i in range(300)],
                   "shed_rps": [(w + 2) / 4 for w in wave],
                   "engines": {"vllm-0": {"limit": [12 + w // 10 for w in wave],
                                          "in_flight": [min(57, w) for w in wave]},
                               "vllm-1": {"limit": [None] * 100 + [3] * 200,
                                          "in_flight": [2] * 300}}},
        "tenants": {
            "acme.prod": {"admitted": 1520,
                          "rejected": {"rate_limited:requests_per_min": 31, "shed": 7}},
            "batchco": {"admitted": 88, "rejected": {"overloaded:queue_full": 402,
                                                     "queue_timeout": 12}},
            "quiet": {"admitted": 3, "rejected": {}},
            "unknown": {"admitted": 0, "rejected": {"unauthorized": 5}},
        },
        "engines": [
            {"id": "vllm-0", "model": "llama", "state": "ready", "kv_cache_usage": 0.934,
             "running": 48, "waiting": 9, "in_flight": 57, "restarts": 0,
             "limit": 15, "mode": "model", "output_tokens_per_hour": 412000.4,
             "cost_per_1k_output_tokens": 0.00971},
            {"id": "vllm-1", "model": "llama", "state": "ready", "kv_cache_usage": 0.0625,
             "running": 2, "waiting": 0, "in_flight": 2, "restarts": 1,
             "limit": 3, "mode": "gradient", "output_tokens_per_hour": 0.0,
             "cost_per_1k_output_tokens": None},
            {"id": "vllm-2", "model": "llama", "state": "restarting", "kv_cache_usage": None,
             "running": 0, "waiting": 0, "in_flight": 0, "restarts": 3,
             "limit": None, "mode": None, "output_tokens_per_hour": 0.0,
             "cost_per_1k_output_tokens": None},
            {"id": "small-0", "model": "small", "state": "starting", "kv_cache_usage": 0.75,
             "running": 0, "waiting": 0, "in_flight": 0, "restarts": 0,
             "limit": None, "mode": None, "output_tokens_per_hour": 0.0,
             "cost_per_1k_output_tokens": None},
            {"id": "small-1", "model": "small", "state": "unhealthy", "kv_cache_usage": 0.5,
             "running": 1, "waiting": 4, "in_flight": 1, "restarts": 0,
             "limit": None, "mode": None, "output_tokens_per_hour": 0.0,
             "cost_per_1k_output_tokens": None},
            {"id": "old-0", "model": "small", "state": "draining", "kv_cache_usage": 0.1,
             "running": 1, "waiting": 0, "in_flight": 1, "restarts": 0,
             "limit": None, "mode": None, "output_tokens_per_hour": 0.0,
             "cost_per_1k_output_tokens": None},
        ],
        "latency": {"ttft_p50_ms": 182.4, "ttft_p99_ms": 2410.0, "tpot_p50_ms": 7.25,
                    "tpot_p99_ms": None},
        "cache": {"lookups": 1600, "hits": 100, "hit_rate": 0.0625},
        "reloads": [
            {"at": now - 600, "path": "/etc/sluice/tenants.yaml", "result": "ok", "error": None},
            {"at": now - 30, "path": "/etc/sluice/tenants.yaml", "result": "error",
             "error": "tenants.yaml: tenants.0.weight = -1 <img src=x onerror=alert(1)>"},
        ],
    }


@contextlib.asynccontextmanager
async def contract_server(feed: dict[str, Any], key: str | None = None):
    """Serves the real page handler and ``feed`` as ``/admin/stats``; records auth."""
    seen: list[str | None] = []

    async def stats(request: web.Request) -> web.Response:
        got = request.headers.get("Authorization")
        seen.append(got)
        if key is not None and got != f"Bearer {key}":
            return web.json_response({"error": {"message": "admin key"}}, status=401)
        return web.json_response(feed)

    app = web.Application()
    app.router.add_get("/dashboard", dashboard)
    app.router.add_get("/admin/stats", stats)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def test_page_matches_contract_feed(browser, tmp_path: Path) -> None:
    feed = contract_feed(time.time())
    async with contract_server(feed) as (base, _):
        w = await open_dashboard(browser, base)
        await wait_updates(w.page, 2)
        assert compare(await dom_stats(w.page), feed) == []
        # charts: one path per series, one point per sample
        assert await chart_points(w.page, "queue_chart") == {
            "interactive": 300, "standard": 300, "batch": 300}
        assert await chart_points(w.page, "rate_chart") == {"admitted": 300, "rejected": 300}
        # a missing limit (none: best effort, or not learned yet) is a gap, never a 0:
        # vllm-1's first 100 samples have none
        assert await chart_points(w.page, "limits_chart") == {
            "vllm-0 limit": 300, "vllm-0 in flight": 300, "vllm-1 limit": 200,
            "vllm-1 in flight": 300}
        # engine state colours and the KV bar level
        states = await w.page.eval_on_selector_all(
            "#engines tr", "rs => rs.map(r => [r.dataset.engine, "
            "r.querySelector('.badge').className, r.querySelector('.kvbar').className])")
        assert states[0] == ["vllm-0", "badge ready", "bar kvbar bad"]
        assert states[2][1] == "badge restarting" and states[3][2] == "bar kvbar warn"
        # tenants sorted by rejections, the header lists every reason
        order = await w.page.eval_on_selector_all("#tenants tr", "rs => rs.map(r => r.dataset.tenant)")
        assert order == ["batchco", "acme.prod", "unknown", "quiet"]
        # the reload error is text, not markup
        assert await w.page.locator("#reloads img").count() == 0
        assert await w.page.text_content("#status") == "REJECTING"
        await w.page.screenshot(path=str(tmp_path / "dashboard-contract.png"), full_page=True)
        assert w.foreign == [] and w.errors == []


async def test_page_needs_admin_key(browser) -> None:
    feed = contract_feed(time.time())
    async with contract_server(feed, key=ADMIN_KEY) as (base, seen):
        w = await open_dashboard(browser, base)
        await w.page.wait_for_selector("#error", state="visible")
        assert "admin key" in (await w.page.text_content("#error") or "")
        assert await w.page.text_content("#status") == "NO DATA"
        assert seen[0] is None
        await w.page.goto(f"{base}/dashboard#key={ADMIN_KEY}")
        await wait_updates(w.page, 1)
        assert seen[-1] == f"Bearer {ADMIN_KEY}"
        assert await w.page.locator("#error").is_hidden()
        assert compare(await dom_stats(w.page), feed) == []
        # typing a key into the form works the same
        await w.page.goto(f"{base}/dashboard")
        await w.page.fill("#key", ADMIN_KEY)
        await w.page.click("#keyform button")
        await wait_updates(w.page, 1)
        assert w.foreign == []


# --------------------------------------------------------------------------- live gateway

TENANTS = [tenant("alpha", priority="interactive", max_queue_wait_s=4),
           tenant("beta", max_queue_wait_s=2),
           tenant("gamma", priority="batch", max_queue_wait_s=1),
           # interactive, so its requests are admitted before the flood's: a request the
           # service refuses itself (503) is refunded its requests/min, and the test needs
           # this tenant to reach its own limit (429)
           tenant("capped", priority="interactive", max_queue_wait_s=4, requests_per_min=6)]


@pytest.fixture(scope="module")
def live_gateway(tmp_path_factory: pytest.TempPathFactory):
    d = write_config(
        tmp_path_factory.mktemp("dashboard"),
        tenants=TENANTS,
        engines=[sim_engine("sim", speed=4.0, replicas=2)],
        models=[{"name": MODEL, "degradation": {"sheddable": ["batch"]}}],
        gateway={"admin_key_hashes": [hash_key(ADMIN_KEY)],
                 "queue": {"max_requests": 12, "default_max_wait_s": 2},
                 "cache": {"enabled": True, "semantic": {"enabled": False}}},
        saturation={"max_in_flight": 3, "max_waiting": 1000},
    )
    with gateways(d, 1) as (gw,):
        yield gw, d


async def fetch_stats(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/admin/stats", headers={"x-api-key": ADMIN_KEY}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def load(session: aiohttp.ClientSession, url: str, duration_s: float) -> dict[int, int]:
    """Closed-loop workers for three priorities, an exact-cache repeat, bad keys and a
    rate-capped tenant; returns the count of each status."""
    rng = random.Random(11)
    statuses: dict[int, int] = {}
    end = time.monotonic() + duration_s

    async def send(headers: dict[str, str], body: dict[str, Any]) -> int:
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            await r.read()
            statuses[r.status] = statuses.get(r.status, 0) + 1
            return r.status

    async def worker(name: str) -> None:
        while time.monotonic() < end:
            status = await send(auth(name), chat("tell me about rivers " * rng.randint(4, 40),
                                                 rng.randint(16, 64), stream=rng.random() < 0.5))
            if status != 200:  # a client that backs off instead of spinning on 503s
                await asyncio.sleep(0.3)

    async def extras() -> None:
        cached = {**chat("what is a sluice gate?", 8), "temperature": 0}
        for i in range(8):
            await send(auth("alpha"), cached)
            await send({"Authorization": f"Bearer wrong-key-{i}"}, chat())
            await send(auth("capped"), chat())
            await send(auth("capped"), chat())
            await asyncio.sleep(0.3)

    names = ["alpha"] * 3 + ["beta"] * 6 + ["gamma"] * 9
    await asyncio.gather(extras(), *(worker(n) for n in names))
    return statuses


async def reload_tenants(config_dir: Path, session: aiohttp.ClientSession, url: str) -> None:
    """A good tenants.yaml change, a bad one (the running config stays), and the good
    file again; waits until the feed reports each."""
    path = config_dir / "tenants.yaml"
    good = path.read_text()
    before = len((await fetch_stats(session, url))["reloads"])
    changed = yaml.safe_load(good)
    changed["tenants"][1]["weight"] = 2.0
    for text, want in ((yaml.safe_dump(changed), before + 1),
                       ("tenants:\n  - name: beta\n    weight: -1\n", before + 2),
                       (yaml.safe_dump(changed), before + 3)):
        staged = path.with_suffix(".staged")  # replaced whole: the watcher never reads
        staged.write_text(text)              # a half-written file (an extra "error")
        staged.replace(path)

        async def reported(want: int = want) -> bool:
            return len((await fetch_stats(session, url))["reloads"]) >= want

        await wait_for(reported, 10, "the feed to report the tenants.yaml reload", poll_s=0.2)


@pytest.mark.load
async def test_live_dashboard_during_load(browser, live_gateway, tmp_path: Path) -> None:
    gw, config_dir = live_gateway
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        w = await open_dashboard(browser, gw.url, f"#key={ADMIN_KEY}")
        await wait_updates(w.page, 1)
        await reload_tenants(config_dir, session, gw.url)

        load_task = asyncio.create_task(load(session, gw.url, duration_s=8.0))
        peak_queue, shot = 0, False
        while not load_task.done():
            await asyncio.sleep(1.0)
            feed = await fetch_stats(session, gw.url)
            depth = sum(v[-1] for v in feed["series"]["queue_depth"].values())
            # the page may be one refresh behind the feed: its counters never lead
            for d in await dom_stats(w.page):
                if d["path"][0] == "tenants":
                    want = lookup(feed, d["path"])
                    assert want is not _MISSING and d["value"] <= want, d
            if depth >= peak_queue and depth > 0 and await updates(w.page) > 2:
                peak_queue = depth
                await w.page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
                shot = True
        statuses = load_task.result()
        assert {200, 401, 429} <= set(statuses), statuses
        assert statuses.get(500, 0) == 0, statuses
        assert shot and peak_queue > 0, "the queue never built up while the page was open"

        # quiescent: the page and a feed fetched at the same moment agree exactly
        problems: list[str] = []
        for _ in range(20):
            n = await updates(w.page)
            await wait_updates(w.page, n + 1)
            dom = await dom_stats(w.page)
            feed = await fetch_stats(session, gw.url)
            problems = compare(dom, feed)
            if not problems:
                break
        assert problems == []

        # what the page showed is the load that ran
        assert feed["tenants"]["alpha"]["admitted"] > 0
        assert any(r.startswith("rate_limited") for r in feed["tenants"]["capped"]["rejected"])
        assert feed["latency"]["ttft_p50_ms"] is not None
        assert feed["latency"]["tpot_p50_ms"] is not None
        assert feed["cache"]["hits"] > 0
        assert [r["result"] for r in feed["reloads"]][-3:] == ["ok", "error", "ok"]
        assert {e["state"] for e in feed["engines"]} == {"ready"}
        charts = await chart_points(w.page, "queue_chart")
        assert set(charts) == {"interactive", "standard", "batch"}
        assert min(charts.values()) >= 10, charts
        assert min((await chart_points(w.page, "rate_chart")).values()) >= 10
        assert max(feed["series"]["queue_depth"]["batch"]) > 0
        # the page draws a non-flat queue line and the error text is shown
        d_batch = await w.page.get_attribute("#queue_chart path[data-series=batch]", "d")
        assert d_batch and len({p.split(",")[1] for p in d_batch[1:].split("L")}) > 1
        assert await w.page.locator("#reloads .bad-text").count() >= 2
        assert w.foreign == [] and w.errors == []

        await w.page.screenshot(path=str(tmp_path / "dashboard-after.png"), full_page=True)

        # the Grafana dashboard's metric names are what this gateway exports
        async with session.get(gw.url + "/metrics") as r:
            exported = set(re.findall(r"^(sluice_\w+)", await r.text(), re.M))
        grafana = json.loads((REPO / "config" / "grafana" / "sluice-dashboard.json").read_text())
        used = set(re.findall(r"\bsluice_\w+", json.dumps(grafana)))
        optional = {"sluice_degraded_total", "sluice_engine_prefix_match_ratio"}  # none here
        assert used - optional <= exported, (used - optional) - exported
    out = REPO / "out"
    out.mkdir(exist_ok=True)
    shutil.copy(tmp_path / "dashboard.png", out / "dashboard.png")
