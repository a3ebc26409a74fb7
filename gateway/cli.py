"""The ``sluice`` command.

* ``sluice serve [--config-dir DIR | --gateway F --engines F --tenants F] [--host H]
  [--port P] [--workers N]``: launch the engines and serve the OpenAI API until
  SIGINT/SIGTERM, then stop accepting, drain in-flight requests and stop the engines.
  ``--workers N`` (N ≥ 2) runs N gateway processes on the port (:mod:`gateway.workers`).
* ``sluice check-config FILE…``: validate files (kind from the name: ``gateway*``,
  ``engines*``, ``tenants*``, or ``--kind``); exit 1 with the errors.
* ``sluice prepare-model [--cache-dir DIR]``: build the packaged model folder.
* ``sluice capacity --url URL``: the capacity report of a running gateway.
* ``sluice batches list|show ID|cancel ID --url URL [--key ADMIN_KEY] [--json]``: every
  tenant's Batch API batches on a running gateway (``/admin/batches``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import sys
from pathlib import Path

from aiohttp import web

from config.loader import FILES, ConfigError, load_config, load_file
from config.schema import Config
from gateway.workers import WorkerRole, run_workers, watch_parent

log = logging.getLogger("sluice")


def _banner(cfg: Config, host: str, port: int) -> str:
    url = f"http://{host}:{port}"
    model = next(iter(cfg.engines.model_names()), "MODEL")
    key = "" if cfg.tenants.allow_anonymous else ' -H "Authorization: Bearer $SLUICE_KEY"'
    sdk_key = "sk-sluice-local" if any(t.name == "local" for t in cfg.tenants.tenants) else "YOUR_KEY"
    return f"""
Sluice is serving the OpenAI API at {url}/v1  (models: {', '.join(cfg.engines.model_names())})

  curl {url}/v1/chat/completions{key} -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 32}}'

  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="{sdk_key}")
  print(client.chat.completions.create(model="{model}",
        messages=[{{"role": "user", "content": "Hello"}}], max_tokens=32).choices[0].message.content)

Stop with Ctrl-C (drains requests and stops the engines).
"""


async def _serve(cfg: Config, host: str, port: int, worker: WorkerRole | None) -> None:
    from gateway.app import create_app
    from gateway.errors import GatewayRunner
    from gateway.keys import RUNNER, SUPERVISOR

    app = create_app(cfg, worker=worker)
    runner = GatewayRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=cfg.gateway.drain_grace_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # SIGHUP means reload (gateway.reload installs its handler once the app runs);
    # one that arrives while starting must not end the process (the default action)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    orphaned = asyncio.create_task(watch_parent(worker, stop)) if worker else None
    await runner.setup()
    # Start-up built a large, long-lived object graph (the embedding model, tokenizers,
    # config): move it out of the collector's reach so full collections stay short
    # (https://docs.python.org/3/library/gc.html#gc.freeze).
    gc.freeze()
    try:
        site = web.TCPSite(runner, host, port, reuse_port=worker is not None)
        await site.start()
        if RUNNER in app:  # batch lines go through this process's own address
            local = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
            app[RUNNER].serve_at(f"http://{local}:{runner.addresses[0][1]}")
        who = f"worker {worker.index} (pid {os.getpid()})" if worker else "Sluice"
        print(f"{who} listening on http://{host}:{port}; starting engines…", flush=True)
        ready = asyncio.create_task(app[SUPERVISOR].wait_ready(cfg.engines.supervisor.startup_grace_s))
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({ready, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and ready.result():
            print(_banner(cfg, host, port) if worker is None or worker.owns_engines
                  else f"{who}: engines ready", flush=True)
        elif ready.done():
            print("Engines did not become ready; see the engine logs. Still serving.", flush=True)
        await waiter
        ready.cancel()
        print("Stopping: draining requests and engines…", flush=True)
    finally:
        if orphaned is not None:
            orphaned.cancel()
        await runner.cleanup()


def _load(args: argparse.Namespace) -> Config:
    return load_config(args.gateway, args.engines, args.tenants, directory=args.config_dir)


def cmd_serve(args: argparse.Namespace) -> int:
    # The gateway runs torch only for the CPU embedding model, never a GPU kernel, but
    # torch._dynamo imports Triton when it is installed (vLLM brings it), and Triton's
    # nanobind bindings print "nanobind: leaked ..." (~600 lines) when the interpreter
    # exits. Not importing it removes that, and its start-up cost.
    sys.modules.setdefault("triton", None)  # type: ignore[arg-type]
    try:
        cfg = _load(args)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 1
    host = args.host or cfg.gateway.host
    port = args.port if args.port is not None else cfg.gateway.port
    if args.workers < 1 or (args.workers > 1 and port == 0):
        print("--workers needs N >= 1 and, for N > 1, a fixed --port", file=sys.stderr)
        return 1
    worker = None
    if args.workers > 1 and args.worker_index is None:
        files = [a for k in ("config_dir", *FILES) if getattr(args, k)
                 for a in (f"--{k.replace('_', '-')}", getattr(args, k))]
        return run_workers(cfg, [*files, "--host", host, "--port", str(port)], args.workers,
                           drain_grace_s=cfg.gateway.drain_grace_s,
                           stop_grace_s=cfg.engines.supervisor.stop_grace_s)
    if args.worker_index is not None:
        worker = WorkerRole(args.worker_index, args.workers, Path(args.address_file),
                            os.getppid())
    try:
        import uvloop

        uvloop.run(_serve(cfg, host, port, worker))
    except ImportError:
        asyncio.run(_serve(cfg, host, port, worker))
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    failed = False
    for name in args.files:
        path = Path(name)
        kind = args.kind or next((k for k in FILES if k in path.name.lower()), None)
        if kind is None:
            print(f"{path}: cannot tell the kind from the name; use --kind", file=sys.stderr)
            failed = True
            continue
        try:
            load_file(kind, path)
            print(f"{path}: ok ({kind})")
        except ConfigError as e:
            print(e, file=sys.stderr)
            failed = True
    return 1 if failed else 0


def cmd_prepare_model(args: argparse.Namespace) -> int:
    from engines.prepare import main as prepare_main

    return prepare_main(["--cache-dir", args.cache_dir] if args.cache_dir else [])


def cmd_capacity(args: argparse.Namespace) -> int:
    """Print ``GET /admin/capacity`` of a running gateway as a table (``--json``: as
    is)."""
    import httpx

    params = {k: v for k, v in (("rate", args.rate), ("model", args.model)) if v is not None}
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    try:
        r = httpx.get(args.url.rstrip("/") + "/admin/capacity", params=params,
                      headers=headers, timeout=10)
    except httpx.HTTPError as e:
        print(f"{args.url}: {e}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        print(f"{args.url}: HTTP {r.status_code}: {r.text}", file=sys.stderr)
        return 1
    data = r.json()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    for m in data["models"]:
        print(capacity_text(m))
    return 0


def capacity_text(m: dict) -> str:
    """One model's ``GET /admin/capacity`` entry in words (``sluice capacity``)."""
    mix = m.get("mix")
    if not mix:
        return f"model {m['model']}: no request finished yet, nothing measured"
    lines = [f"model {m['model']}: requests of {mix['prompt_tokens']:.0f} prompt tokens "
             f"({mix['uncached_tokens']:.0f} uncached) and {mix['output_tokens']:.0f} "
             "output tokens on average"]
    for e in m["engines"]:
        kv = e.get("kv_capacity_tokens")
        kv_text = "KV cache not reported" if kv is None else f"KV cache {kv:,} tokens"
        lines.append(f"  engine {e['engine']} ({e['kind']} engine, spec {e.get('spec', '?')}; "
                     f"{kv_text}; admission: {e['mode'].replace('_', ' ')})")
        for band, v in e["bands"].items():
            if v.get("within_slo", v["requests_per_s"] > 0):
                lines.append(f"    {band}: {v['requests_per_s']:.2f} requests/s within the "
                             f"SLO at up to {v['max_num_seqs']} in flight (knee {v['knee']})")
            else:
                lines.append(f"    {band}: cannot meet the SLO even with one request; at best "
                             f"effort {v.get('best_effort_requests_per_s', 0):.2f} requests/s "
                             f"at up to {v.get('throughput_knee', '?')} in flight "
                             "(throughput knee)")
    fleet = m.get("fleet")
    if fleet:
        for spec, f in fleet["by_kind"].items():
            what = f"{spec} ({f.get('engine_kind', spec)} engine)"
            if f["engines"] is None:
                lines.append(f"  {m['target_rate']} requests/s within the {fleet['band']} "
                             f"SLO: no number of {what} meets it")
                continue
            price = "" if f["cost_per_hour"] is None else f", {f['cost_per_hour']} per hour"
            lines.append(f"  {m['target_rate']} requests/s within the {fleet['band']} SLO: "
                         f"{f['engines']} x {what}{price}")
    return "\n".join(lines)


def _admin(method: str, url: str, path: str, key: str | None,
           params: dict[str, str] | None = None) -> dict | None:
    """One admin request; its JSON, or None after printing why it failed."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.request(method, url.rstrip("/") + path, params=params, headers=headers,
                          timeout=10)
    except httpx.HTTPError as e:
        print(f"{url}: {e}", file=sys.stderr)
        return None
    if r.status_code != 200:
        print(f"{url}: HTTP {r.status_code}: {r.text}", file=sys.stderr)
        return None
    return r.json()


def _batch_line(b: dict) -> str:
    c = b["request_counts"]
    return (f"{b['id']:32} {b.get('tenant', ''):12} {b['status']:11} "
            f"{c['completed']:>6}/{c['total']:<6} failed {c['failed']:<5} "
            f"{b['endpoint']}")


def cmd_batches(args: argparse.Namespace) -> int:
    """``sluice batches list|show|cancel``: every tenant's batches (operators; the
    admin key as ``sluice capacity``)."""
    if args.action == "list":
        params = {"limit": str(args.limit)}
        data = _admin("GET", args.url, "/admin/batches", args.key, params)
        if data is None:
            return 1
        if args.json:
            print(json.dumps(data, indent=2))
        else:
            for b in data["data"]:
                print(_batch_line(b))
            if not data["data"]:
                print("no batches")
        return 0
    if not args.id:
        print(f"sluice batches {args.action} needs a batch id", file=sys.stderr)
        return 1
    path = f"/admin/batches/{args.id}" + ("/cancel" if args.action == "cancel" else "")
    data = _admin("POST" if args.action == "cancel" else "GET", args.url, path, args.key)
    if data is None:
        return 1
    print(json.dumps(data, indent=2) if args.json or args.action == "show" else _batch_line(data))
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="launch engines and serve the OpenAI API")
    serve.add_argument("--config-dir", help="folder with gateway.yaml, engines.yaml, tenants.yaml")
    for kind in FILES:
        serve.add_argument(f"--{kind}", help=f"path of {kind}.yaml")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--workers", type=int, default=1,
                       help="gateway processes on the port (SO_REUSEPORT); default 1")
    # set by the parent of --workers N for each worker
    serve.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    serve.add_argument("--address-file", help=argparse.SUPPRESS)
    serve.set_defaults(func=cmd_serve)
    check = sub.add_parser("check-config", help="validate configuration files")
    check.add_argument("files", nargs="+")
    check.add_argument("--kind", choices=list(FILES))
    check.set_defaults(func=cmd_check_config)
    prep = sub.add_parser("prepare-model", help="prepare the packaged Gemma 3 270M for vLLM")
    prep.add_argument("--cache-dir")
    prep.set_defaults(func=cmd_prepare_model)
    cap = sub.add_parser("capacity", help="capacity report of a running gateway")
    cap.add_argument("--url", required=True, help="the gateway, e.g. http://127.0.0.1:8000")
    cap.add_argument("--rate", type=float, help="target requests/s to size the fleet for")
    cap.add_argument("--model")
    cap.add_argument("--key", help="admin key")
    cap.add_argument("--json", action="store_true", help="print the JSON report")
    cap.set_defaults(func=cmd_capacity)
    bat = sub.add_parser("batches", help="list, show or cancel a running gateway's batches")
    bat.add_argument("action", choices=["list", "show", "cancel"])
    bat.add_argument("id", nargs="?", help="batch id (show, cancel)")
    bat.add_argument("--url", required=True, help="the gateway, e.g. http://127.0.0.1:8000")
    bat.add_argument("--key", help="admin key")
    bat.add_argument("--limit", type=int, default=20, help="batches listed (1-100)")
    bat.add_argument("--json", action="store_true", help="print the JSON")
    bat.set_defaults(func=cmd_batches)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
