"""``python -m loadtest overhead --json PATH [--observability on|off] [--duration S]``:
what the gateway itself costs per request.

Three paths on loopback in front of the same instant engine stand-in
(:mod:`loadtest.stand_in`):

* ``direct``: the load generator talks to the stand-in;
* ``passthrough``: a minimal aiohttp reverse proxy (one shared ``ClientSession``,
  bytes streamed through) — the floor any aiohttp proxy pays;
* ``gateway``: ``sluice serve`` with its default pipeline (anonymous tenant,
  in-memory limits, the cache as shipped, the stand-in as an ``external`` engine).

Cells: closed-loop concurrency 1, 16 and 64 non-streaming (``c1``, ``c16``,
``c64``) and 16 streaming with 64 content chunks (``stream16``), all chat
completions; ``responses``: 64 non-streaming OpenAI Responses requests
(``/v1/responses``, the same 64-token answer), whose gateway CPU per request
``ratio_responses_chat_cpu`` compares with the chat ``c64`` cell's. Requests use the
default temperature, so the response cache is consulted but never answers (the
cost measured is the pipeline's, not a cache hit's).

``long`` (gateway only, when the packaged Gemma 3 model is prepared): 16 workers,
each replaying Mooncake-length conversations (:func:`long_bodies`: a 2,000-token
system prompt, then turns of 2,000 user + 500 assistant tokens, 8 turns: prompts
of 4k–20k tokens, ~13k on average; the Mooncake conversation trace averages
12,035 input tokens) to a second stand-in served as an ``external`` engine with
``tokenizer: packaged:gemma3-270m``, so the gateway tokenizes with the real Gemma
tokenizer. It runs on the shipped gateway (turn cache on) and on a second gateway
with ``scheduler.prefix.turn_cache_tokens: 0`` (every prompt tokenized whole), the
"before"; ``long_cpu_ms_per_req`` reports both.

Load comes from a separate process (uvloop + aiohttp client, keep-alive, one
connection per worker); for each cell it warms up, then measures for ``--duration``
seconds, and on until as many requests as the cell has clients have finished in the
window (at most :data:`MAX_EXTRA_S` more: a short window on a busy machine can
otherwise end before the first answer and measure nothing): ``rps`` (completed
requests / s of the window), ``p50_ms``/``p99_ms`` (request latency,
whole body read), ``cpu_ms_per_req`` (the server process's own user+system CPU from
``/proc/PID/stat`` over the window / requests; the stand-in's for ``direct``, the
proxy's for the others), and the generator's own CPU use (``generator_cpu_util``,
fraction of one core: near 1.0 means the generator, not the server, was the limit).
``ratio_gateway_passthrough_c64`` is gateway rps / passthrough rps at c64;
``added_p50_ms_c1`` is gateway p50 − direct p50 at c1. With ``--repeat N`` the
cells are interleaved across paths N times and each figure is the median, with the
per-run rps kept in ``rps_runs``.

``--workers N`` (N ≥ 2) adds the path ``gateway_workers`` (``sluice serve --workers
N`` on the same config: N processes on one port, the kernel spreading the
generator's connections over them); its ``cpu_ms_per_req`` is the CPU of all its
processes (parent and workers) per request. ``workers`` then gives, per worker
count (``"1"``: the ``gateway`` path, ``"N"``: ``gateway_workers``),
``c64_rps`` and ``cpu_ms_per_req`` (c64), and ``ratio_gateway_workers_passthrough_c64``
the N-worker rps over the pass-through's at c64.

``--observability off`` runs the gateway with metrics, tracing and access logs off
(``gateway.yaml`` ``observability`` section); ``on`` (default) as shipped.
``--pin`` puts the generator on CPU 0 and the servers (stand-in and proxy) on CPU 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import yaml

from loadtest.launch import free_port

PATHS = ("direct", "passthrough", "gateway")
CELLS: dict[str, tuple[int, bool]] = {"c1": (1, False), "c16": (16, False),
                                      "c64": (64, False), "stream16": (16, True),
                                      "responses": (64, False), "long": (16, False)}
#: The path each cell posts to (the others: chat completions).
CELL_PATHS = {"responses": "/v1/responses"}
LONG_MODEL = "stand-in-long"
#: The gateway variant without the turn cache (the "before" of the long cell).
NO_TURN_CACHE = "gateway_no_turn_cache"
#: The gateway run with ``--workers N`` (N from the command line).
WORKERS = "gateway_workers"
METRICS = ("rps", "p50_ms", "p99_ms", "cpu_ms_per_req")
MODEL = "stand-in"
CHUNKS = 64
ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process ``pid`` (all its threads, not its children), s."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)


def tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants now (a ``--workers`` gateway's workers)."""
    import psutil

    return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]


def long_bodies(worker: int) -> Iterator[bytes]:
    """Request bodies of one worker's conversations, forever (see module doc)."""
    from loadtest.workloads.base import synthetic_text

    conv = 0
    while True:
        key = f"w{worker}c{conv}"
        messages = [{"role": "system", "content": synthetic_text(f"{key}/s", 2000)}]
        for turn in range(8):
            messages.append({"role": "user", "content": synthetic_text(f"{key}/u{turn}", 2000)})
            yield json.dumps({"model": LONG_MODEL, "max_tokens": CHUNKS,
                              "messages": messages}).encode()
            messages.append({"role": "assistant",
                             "content": synthetic_text(f"{key}/a{turn}", 500)})
        conv += 1


def request_body(stream: bool, path: str = "/v1/chat/completions") -> bytes:
    if path == "/v1/responses":
        return json.dumps({"model": MODEL, "max_output_tokens": CHUNKS,
                           "input": "Say something short."}).encode()
    body: dict[str, Any] = {"model": MODEL, "max_tokens": CHUNKS,
                            "messages": [{"role": "user", "content": "Say something short."}]}
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


# --------------------------------------------------------------------------- passthrough


async def _passthrough(port: int, upstream: str) -> None:
    """The baseline: a minimal aiohttp reverse proxy streaming bytes through."""
    import aiohttp
    from aiohttp import web

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    auto_decompress=False)

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with session.post(upstream + request.path, data=body,
                                headers={"Content-Type": "application/json"}) as up:
            ctype = up.headers.get("Content-Type", "application/json")
            if up.content_length is not None:
                return web.Response(status=up.status, body=await up.read(),
                                    headers={"Content-Type": ctype})
            out = web.StreamResponse(status=up.status, headers={"Content-Type": ctype})
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/v1/responses", handler)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("passthrough ready", flush=True)
    await asyncio.Event().wait()


# --------------------------------------------------------------------------- generator


#: Longest the measured window is extended past ``--duration`` while fewer requests
#: than the cell's clients have finished in it, s.
MAX_EXTRA_S = 60.0


async def _generate(url: str, concurrency: int, stream: bool, warmup_s: float,
                    duration_s: float, pids: list[int], long: bool = False) -> dict[str, Any]:
    """Closed loop: ``concurrency`` workers, each on its own keep-alive connection
    (``long``: each sending :func:`long_bodies`); CPU is summed over ``pids``."""
    import aiohttp

    fixed = request_body(stream, "/" + url.split("/", 3)[3])
    headers = {"Content-Type": "application/json"}
    lat: list[float] = []
    errors = 0
    window = [float("inf"), float("inf")]
    stop = False

    async def worker(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal errors
        bodies = long_bodies(i) if long else None
        while not stop:
            body = next(bodies) if bodies is not None else fixed
            t0 = time.perf_counter()
            try:
                async with session.post(url, data=body, headers=headers) as r:
                    data = await r.read()
                    ok = r.status == 200 and (not stream or data.endswith(b"data: [DONE]\n\n"))
            except aiohttp.ClientError:
                ok = False
            t1 = time.perf_counter()
            if window[0] <= t1 <= window[1]:
                if ok:
                    lat.append(t1 - t0)
                else:
                    errors += 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [asyncio.create_task(worker(session, i)) for i in range(concurrency)]
        await asyncio.sleep(warmup_s)
        cpu0, own0, t_start = (sum(map(cpu_seconds, pids)), time.process_time(),
                               time.perf_counter())
        window[:] = [t_start, t_start + duration_s + MAX_EXTRA_S]
        await asyncio.sleep(duration_s)
        while len(lat) + errors < concurrency and time.perf_counter() < window[1]:
            await asyncio.sleep(0.01)
        cpu1, own1, t_end = (sum(map(cpu_seconds, pids)), time.process_time(),
                             time.perf_counter())
        window[1] = t_end
        stop = True
        await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = t_end - t_start
    n = len(lat)
    lat.sort()

    def pct(q: float) -> float | None:
        return round(lat[min(n - 1, int(q * n))] * 1000, 3) if n else None

    return {
        "rps": round(n / elapsed, 1), "p50_ms": pct(0.50), "p99_ms": pct(0.99),
        "cpu_ms_per_req": round((cpu1 - cpu0) * 1000 / n, 4) if n else None,
        "requests": n, "errors": errors, "window_s": round(elapsed, 3),
        "server_cpu_util": round((cpu1 - cpu0) / elapsed, 3),
        "generator_cpu_util": round((own1 - own0) / elapsed, 3),
    }


def _child(argv: list[str]) -> int:
    """Entry point of the helper processes (``passthrough`` and ``generate``)."""
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run  # type: ignore[assignment]
    if argv[0] == "passthrough":
        run(_passthrough(int(argv[1]), argv[2]))
    elif argv[0] == "generate":
        url, conc, stream, warm, dur, pids, long = argv[1:8]
        out = run(_generate(url, int(conc), stream == "1", float(warm), float(dur),
                            [int(p) for p in pids.split(",")], long == "1"))
        print(json.dumps(out), flush=True)
    return 0


# --------------------------------------------------------------------------- orchestration


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"port {port} did not open")


@contextmanager
def _process(cmd: list[str], port: int, cpus: set[int] | None) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    try:
        _wait_port(port, proc)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def gateway_config(directory: Path, engine_url: str, observability: bool,
                   long_url: str | None = None, turn_cache: bool = True) -> Path:
    """Write gateway/engines/tenants YAML for the benchmark: the shipped gateway.yaml
    (cache included) and scheduler, one ``external`` engine, anonymous tenant; with
    ``long_url`` a second external engine (model ``stand-in-long``) tokenized with
    the packaged Gemma model's tokenizer; ``turn_cache`` False sets
    ``scheduler.prefix.turn_cache_tokens: 0``."""
    shipped = ROOT / "config"
    gw = yaml.safe_load((shipped / "gateway.yaml").read_text()) or {}
    if not observability:
        gw["observability"] = {**(gw.get("observability") or {}),
                               "metrics": False, "tracing": False, "access_log": False}
    engines = yaml.safe_load((shipped / "engines.yaml").read_text()) or {}
    engines["engines"] = [{"name": "stand-in-0", "model": MODEL, "kind": "external",
                           "url": engine_url}]
    if long_url is not None:
        engines["engines"].append({"name": "stand-in-long", "model": LONG_MODEL,
                                   "kind": "external", "url": long_url,
                                   "tokenizer": "packaged:gemma3-270m"})
    if not turn_cache:
        engines.setdefault("scheduler", {}).setdefault("prefix", {})["turn_cache_tokens"] = 0
    tenants = yaml.safe_load((shipped / "tenants.yaml").read_text()) or {}
    tenants["allow_anonymous"] = True
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in (("gateway", gw), ("engines", engines), ("tenants", tenants)):
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return directory


def _run_cell(url: str, pid: int, cell: str, warmup_s: float, duration_s: float,
              cpus: set[int] | None) -> dict[str, Any]:
    conc, stream = CELLS[cell]
    cmd = [sys.executable, "-m", "loadtest.overhead", "generate",
           url + CELL_PATHS.get(cell, "/v1/chat/completions"),
           str(conc), "1" if stream else "0", str(warmup_s), str(duration_s),
           ",".join(map(str, tree_pids(pid))),
           "1" if cell == "long" else "0"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, check=True,
                         timeout=warmup_s + duration_s + 120,
                         preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in runs[0]:
        vals = [r[k] for r in runs if r[k] is not None]
        out[k] = (round(statistics.median(vals), 4) if vals else None) if k != "requests" \
            else sum(vals)
    out["rps_runs"] = [r["rps"] for r in runs]
    return out


def _long_available() -> bool:
    from engines.prepare import MODEL_DIRNAME, default_cache_dir, is_prepared

    return is_prepared(default_cache_dir() / MODEL_DIRNAME)


def run(duration_s: float, warmup_s: float, observability: bool, repeat: int, pin: bool,
        cells: list[str], paths: list[str], gateway_log: Path | None,
        workers: int = 1) -> dict[str, Any]:
    """Run the benchmark; returns the JSON document (see the module docstring)."""
    from loadtest.launch import gateway

    server_cpus = {1} if pin else None
    gen_cpus = {0} if pin else None
    all_cpus = os.sched_getaffinity(0)
    loadavg_start = os.getloadavg()
    if "long" in cells and ("gateway" not in paths or not _long_available()):
        print("long cell skipped: needs the gateway path and the prepared packaged model "
              "(sluice prepare-model)", file=sys.stderr)
        cells = [c for c in cells if c != "long"]
    long_paths = ["gateway", NO_TURN_CACHE] if "long" in cells else []
    if workers > 1 and "gateway" in paths:
        paths = [*paths, WORKERS]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        p: {c: [] for c in cells} for p in [*paths, *long_paths[1:]]}

    def start(cmd: list[str], port: int) -> subprocess.Popen[bytes]:
        return stack.enter_context(_process(cmd, port, server_cpus))

    def stand_in(model: str) -> tuple[str, int]:
        port = free_port()
        proc = start([sys.executable, "-m", "loadtest.stand_in", "--port", str(port),
                             "--model", model, "--chunks", str(CHUNKS)], port)
        return f"http://127.0.0.1:{port}", proc.pid

    def serve(cfg_dir: Path, args: list[str] | None = None) -> tuple[str, int]:
        if server_cpus:
            os.sched_setaffinity(0, server_cpus)  # inherited by sluice serve
        try:
            gw = stack.enter_context(gateway(cfg_dir, ready_timeout_s=300, log_path=gateway_log,
                                             extra_args=args))
        finally:
            os.sched_setaffinity(0, all_cpus)
        return gw.url, gw.proc.pid

    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="sluice-overhead-") as tmp:
        engine_url, engine_pid = stand_in(MODEL)
        long_url = stand_in(LONG_MODEL)[0] if long_paths else None
        targets: dict[str, tuple[str, int]] = {"direct": (engine_url, engine_pid)}
        if "passthrough" in paths:
            pport = free_port()
            proxy = start([sys.executable, "-m", "loadtest.overhead", "passthrough", str(pport),
                           engine_url], pport)
            targets["passthrough"] = (f"http://127.0.0.1:{pport}", proxy.pid)
        if "gateway" in paths:
            targets["gateway"] = serve(gateway_config(Path(tmp) / "config", engine_url,
                                                      observability, long_url))
        if WORKERS in paths:
            targets[WORKERS] = serve(Path(tmp) / "config", ["--workers", str(workers)])
        if long_paths:
            targets[NO_TURN_CACHE] = serve(gateway_config(
                Path(tmp) / "config-no-turn-cache", engine_url, observability, long_url,
                turn_cache=False))
        for _ in range(repeat):
            for cell in cells:
                for path in (long_paths if cell == "long" else paths):
                    url, pid = targets[path]
                    r = _run_cell(url, pid, cell, warmup_s, duration_s, gen_cpus)
                    results[path][cell].append(r)
                    print(f"  {path:<16}{cell:<9} rps {r['rps']:>8.1f}  p50 {r['p50_ms']} ms  "
                          f"p99 {r['p99_ms']} ms  cpu/req {r['cpu_ms_per_req']} ms  "
                          f"errors {r['errors']}  gen cpu {r['generator_cpu_util']}",
                          file=sys.stderr, flush=True)
    doc: dict[str, Any] = {p: {c: _median(runs) for c, runs in cells_.items() if runs}
                           for p, cells_ in results.items()}

    def get(path: str, cell: str, key: str) -> float | None:
        return (doc.get(path) or {}).get(cell, {}).get(key)

    gw_rps, pt_rps = get("gateway", "c64", "rps"), get("passthrough", "c64", "rps")
    doc["ratio_gateway_passthrough_c64"] = round(gw_rps / pt_rps, 3) if gw_rps and pt_rps else None
    resp_cpu, chat_cpu = (get("gateway", "responses", "cpu_ms_per_req"),
                          get("gateway", "c64", "cpu_ms_per_req"))
    doc["ratio_responses_chat_cpu"] = round(resp_cpu / chat_cpu, 3) \
        if resp_cpu and chat_cpu else None
    gw_p50, d_p50 = get("gateway", "c1", "p50_ms"), get("direct", "c1", "p50_ms")
    doc["added_p50_ms_c1"] = round(gw_p50 - d_p50, 3) if gw_p50 and d_p50 else None
    if WORKERS in paths:
        doc["workers"] = {str(n): {"c64_rps": get(p, "c64", "rps"),
                                   "cpu_ms_per_req": get(p, "c64", "cpu_ms_per_req")}
                          for n, p in ((1, "gateway"), (workers, WORKERS))}
        w_rps = get(WORKERS, "c64", "rps")
        doc["ratio_gateway_workers_passthrough_c64"] = (
            round(w_rps / pt_rps, 3) if w_rps and pt_rps else None)
    if long_paths:
        doc["long_cpu_ms_per_req"] = {"turn_cache": get("gateway", "long", "cpu_ms_per_req"),
                                      "no_turn_cache": get(NO_TURN_CACHE, "long",
                                                           "cpu_ms_per_req")}
    doc["meta"] = {"duration_s": duration_s, "warmup_s": warmup_s, "repeat": repeat,
                   "observability": "on" if observability else "off", "pinned": pin,
                   "workers": workers, "loadavg_start": loadavg_start,
                   "cpus": os.cpu_count(), "loadavg_end": os.getloadavg(),
                   "stream_chunks": CHUNKS, "python": sys.version.split()[0]}
    return doc


def table(doc: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    lines = ["| path | cell | rps | p50 ms | p99 ms | CPU ms/req |", "|---|---|---|---|---|---|"]
    for path in (*PATHS, WORKERS, NO_TURN_CACHE):
        for cell, r in (doc.get(path) or {}).items():
            lines.append(f"| {path} | {cell} | {r['rps']} | {r['p50_ms']} | {r['p99_ms']} | "
                         f"{r['cpu_ms_per_req']} |")
    lines.append(f"\nratio gateway/passthrough at c64: {doc['ratio_gateway_passthrough_c64']}; "
                 f"p50 added at c1 (gateway − direct): {doc['added_p50_ms_c1']} ms")
    if "workers" in doc:
        lines.append(f"c64 by worker count: {doc['workers']}; ratio with "
                     f"{doc['meta']['workers']} workers / passthrough: "
                     f"{doc['ratio_gateway_workers_passthrough_c64']}")
    if "long_cpu_ms_per_req" in doc:
        lines.append(f"long cell, gateway CPU ms per request: {doc['long_cpu_ms_per_req']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest overhead",
                                description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="write the results here")
    p.add_argument("--observability", choices=("on", "off"), default="on")
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per cell")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds per cell")
    p.add_argument("--repeat", type=int, default=1, help="interleaved repetitions (median)")
    p.add_argument("--pin", action="store_true", help="generator on CPU 0, servers on CPU 1")
    p.add_argument("--cells", default=",".join(CELLS), help="comma-separated subset of cells")
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of paths")
    p.add_argument("--gateway-log", type=Path, help="keep the gateway's output here")
    p.add_argument("--workers", type=int, default=1,
                   help="also run the gateway with sluice serve --workers N (N >= 2)")
    args = p.parse_args(argv)
    cells = [c for c in args.cells.split(",") if c]
    paths = [x for x in args.paths.split(",") if x]
    if unknown := (set(cells) - set(CELLS)) | (set(paths) - set(PATHS)):
        p.error(f"unknown cells/paths: {sorted(unknown)}")
    doc = run(args.duration, args.warmup, args.observability == "on", args.repeat, args.pin,
              cells, paths, args.gateway_log, args.workers)
    Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    print(table(doc))
    return 0


if __name__ == "__main__":
    _argv = sys.argv[1:]
    sys.exit(_child(_argv) if _argv and _argv[0] in ("passthrough", "generate") else main(_argv))
