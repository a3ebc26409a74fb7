"""``python -m loadtest.sim_engine --port P --profile NAME [options]``: serve one
simulated engine (vLLM's dialect, or ``--dialect``) until SIGINT/SIGTERM.

Fault injection: SIGUSR1 freezes the engine (no more tokens, ``/health`` still 200:
a hung engine that looks healthy), SIGUSR2 thaws it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

from loadtest.sim_engine.dialects import DIALECTS
from loadtest.sim_engine.disagg import CONNECTORS, ROLES, SimConnector
from loadtest.sim_engine.engine import SimEngine
from loadtest.sim_engine.kv_events import KVEventsConfig, SimEventPublisher
from loadtest.sim_engine.profiles import PROFILES, get_profile
from loadtest.sim_engine.server import serve


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.sim_engine",
                                description="Simulated vLLM engine (OpenAI API).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="sim-model", help="served model name")
    p.add_argument("--dialect", default="vllm", choices=sorted(DIALECTS),
                   help="which engine's paths, metric names and quirks to speak "
                   "(loadtest/sim_engine/dialects.py; default vllm)")
    p.add_argument("--profile", default="cpu-gemma3-270m-quiet", choices=sorted(PROFILES))
    p.add_argument("--speed", type=float, default=1.0,
                   help="simulated seconds per wall second (default 1)")
    p.add_argument("--num-blocks", type=int, help="override the profile's KV blocks")
    p.add_argument("--block-size", type=int, help="override tokens per KV block")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--kv-events-config", type=KVEventsConfig.from_json,
                   help="vLLM's KV-event publisher config (JSON)")
    p.add_argument("--role", choices=ROLES, default="both",
                   help="disaggregated serving: prefill legs, decode legs or both "
                        "(needs --kv-connector)")
    p.add_argument("--kv-connector", choices=CONNECTORS,
                   help="accept kv_transfer_params (vLLM's connector protocol)")
    p.add_argument("--kv-transfer-gbps", type=float, default=100.0,
                   help="KV read bandwidth, Gbit/s (default 100: one 100 GbE / EDR link)")
    p.add_argument("--kv-lease-s", type=float, default=30.0,
                   help="how long finished prefill blocks wait for their read, s "
                        "(vLLM's kv_lease_duration)")
    p.add_argument("--kv-load-failure-policy", choices=("recompute", "fail"),
                   default="recompute",
                   help="blocks gone: prefill locally, or fail the request (vLLM's default)")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens")
    p.add_argument("--compress", action="store_true",
                   help="compress answers (gzip/deflate) when Accept-Encoding allows it")
    args = p.parse_args(argv)
    if args.role != "both" and args.kv_connector is None:
        p.error("--role prefill/decode needs --kv-connector")
    return args


async def _serve_forever(args: argparse.Namespace) -> None:
    profile = get_profile(args.profile).with_overrides(
        num_blocks=args.num_blocks, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len)
    events = args.kv_events_config
    publisher = SimEventPublisher(events) if events is not None and events.enabled else None
    engine = SimEngine(profile, args.model, speed=args.speed, publisher=publisher,
                       scheduling_policy=args.scheduling_policy,
                       prompt_tokens_details=args.enable_prompt_tokens_details)
    connector = None if args.kv_connector is None else SimConnector(
        engine, args.role, args.kv_transfer_gbps, args.kv_lease_s,
        args.kv_load_failure_policy)
    runner = await serve(engine, args.host, args.port, connector, args.dialect,
                         args.compress)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, engine.freeze)
    loop.add_signal_handler(signal.SIGUSR2, engine.thaw)
    print(f"sim engine {args.model} ({profile.name}, {args.dialect}, speed {args.speed}, "
          f"role {args.role}) on "
          f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        uvloop = None
    with contextlib.suppress(KeyboardInterrupt):
        if uvloop is not None:
            uvloop.run(_serve_forever(args))
        else:
            asyncio.run(_serve_forever(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
