"""Capacity from the learned latency models: each engine's knee per SLO band, the
``--max-num-seqs`` it implies, its throughput on the observed request mix, and how
many engines of each kind a target request rate needs (pure functions; the gateway
serves them at ``GET /admin/capacity``).

Per engine and band (targets ``ttft_s``, ``tpot_s``), for the mix's mean prompt
tokens ``p``, uncached prompt tokens ``u`` and output tokens ``o``:

* ``knee`` — the largest batch whose TPOT̂ (+ ``z`` σ) meets ``tpot_s``
  (:meth:`~limits.latency_model.LatencyModel.knee`);
* the memory ledger: a request holds ``ceil((p + o) / block_size)`` KV blocks at its
  end, so at most ``num_blocks / blocks_per_request`` fit at once (vLLM's block
  manager admits no more without preempting);
* ``concurrency = min(knee, KV bound)`` — the ``--max-num-seqs`` the engine should
  run with for that band;
* throughput by Little's law, ``concurrency / (TTFT̂(u, concurrency) + TPOT̂ × (o − 1))``
  requests/s, and ``× o`` output tokens/s — 0 when the band's SLO cannot be met there
  at all: one request alone misses its TTFT target (TTFT̂(u, 0) + ``z`` σ) or its TPOT
  target (TPOT̂(1) + ``z`` σ, where the engine serves that band at best effort,
  :meth:`~limits.engine_latency.EngineLatency.best_effort`); ``within_slo`` says
  which;
* at best effort, what the admission holds the engine to instead: its throughput
  knee (:meth:`~limits.latency_model.LatencyModel.throughput_knee`) and the requests/s
  it serves there by the same Little's law (``best_effort_requests_per_s``).

Engines needed for a rate ``R``: ``ceil(R / throughput)`` of one kind (its spec
name), priced at ``cost_per_hour`` when the spec declares one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from limits.latency_model import LatencyModel


@dataclass(frozen=True)
class Mix:
    """The observed request mix: means per request, tokens."""

    prompt_tokens: float
    uncached_tokens: float
    output_tokens: float


@dataclass(frozen=True)
class EngineView:
    """What the report needs of one engine: ``kind`` is its spec's name (engines of
    one spec are one kind of hardware and price: the fleet is sized per spec),
    ``engine_kind`` the serving engine (``vllm``, ``llamacpp``, ``sim``, or an
    external engine's dialect), ``kv_capacity_tokens`` the KV cache one request may
    fill as the engine reports it (:attr:`engines.pool.Engine.kv_capacity_tokens`)."""

    id: str
    kind: str
    model: LatencyModel
    mode: str
    block_size: int | None
    num_blocks: int | None
    cost_per_hour: float | None
    engine_kind: str | None = None
    kv_capacity_tokens: int | None = None


def band_capacity(model: LatencyModel, mix: Mix, ttft_s: float, tpot_s: float, z: float,
                  block_size: int | None, num_blocks: int | None) -> dict[str, float | int | None]:
    """One engine's knee, KV bound, concurrency and throughput for one band (see the
    module docstring); throughput 0 when even one request alone misses ``ttft_s`` or
    ``tpot_s``."""
    knee = model.knee(tpot_s, z)
    blocks = math.ceil((mix.prompt_tokens + mix.output_tokens) / block_size) if block_size else None
    kv_bound = num_blocks // blocks if blocks and num_blocks else None
    concurrency = max(1, min(knee, kv_bound) if kv_bound is not None else knee)
    ttft = model.predict_ttft(mix.uncached_tokens, concurrency).mean
    tpot = model.predict_tpot(concurrency).mean
    service = ttft + tpot * max(0.0, mix.output_tokens - 1)
    meets = (model.predict_ttft(mix.uncached_tokens, 0).upper(z) <= ttft_s
             and model.tpot_alone_s(z) <= tpot_s)
    rps = concurrency / service if service > 0 and meets else 0.0
    out: dict[str, float | int | bool | None] = {
        "knee": knee, "kv_blocks_per_request": blocks, "kv_bound": kv_bound,
        "max_num_seqs": concurrency, "requests_per_s": round(rps, 4),
        "output_tokens_per_s": round(rps * mix.output_tokens, 2), "within_slo": meets}
    if not meets:  # best effort: held at the throughput knee
        held = model.throughput_knee()
        if kv_bound is not None:
            held = max(1, min(held, kv_bound))
        at = (model.predict_ttft(mix.uncached_tokens, held).mean
              + model.predict_tpot(held).mean * max(0.0, mix.output_tokens - 1))
        out["throughput_knee"] = held
        out["best_effort_requests_per_s"] = round(held / at, 4) if at > 0 else 0.0
    return out


def report(engines: Sequence[EngineView], mix: Mix, slo: Mapping[str, tuple[float, float]],
           z: float, target_rate: float | None) -> dict[str, object]:
    """The capacity report (JSON-ready).

    Args:
        engines: the engines with a latency model.
        mix: the observed request mix.
        slo: band → (ttft_s, tpot_s).
        z: the admission's confidence (standard deviations).
        target_rate: requests/s to size the fleet for, or None.
    """
    rows = []
    for e in engines:
        bands = {b: band_capacity(e.model, mix, t, p, z, e.block_size, e.num_blocks)
                 for b, (t, p) in slo.items()}
        rows.append({"engine": e.id, "spec": e.kind, "kind": e.engine_kind or e.kind,
                     "kv_capacity_tokens": e.kv_capacity_tokens, "mode": e.mode,
                     "params": {k: round(float(v), 6) for k, v in e.model.params().items()},
                     "cost_per_hour": e.cost_per_hour, "bands": bands})
    out: dict[str, object] = {
        "mix": {"prompt_tokens": round(mix.prompt_tokens, 1),
                "uncached_tokens": round(mix.uncached_tokens, 1),
                "output_tokens": round(mix.output_tokens, 1)},
        "slo": {b: {"ttft_s": t, "tpot_s": p} for b, (t, p) in slo.items()},
        "engines": rows, "target_rate": target_rate}
    if target_rate is not None and rows:
        tightest = min(slo, key=lambda b: slo[b][1])
        fleet = {}
        for kind in dict.fromkeys(r["spec"] for r in rows):
            mine = [r for r in rows if r["spec"] == kind]
            rps = sum(r["bands"][tightest]["requests_per_s"] for r in mine) / len(mine)
            n = math.ceil(target_rate / rps) if rps > 0 else None
            cost = mine[0]["cost_per_hour"]
            fleet[kind] = {"engine_kind": mine[0]["kind"],
                           "requests_per_s_per_engine": round(rps, 4), "engines": n,
                           "cost_per_hour": round(n * cost, 4) if n and cost is not None else None}
        out["fleet"] = {"band": tightest, "by_kind": fleet}
    return out


def desired_engines(engines: Sequence[EngineView], mix: Mix, ttft_s: float, tpot_s: float,
                    z: float, rate: float) -> float:
    """Engines the current arrival ``rate`` (requests/s) needs at the mean throughput
    of ``engines`` for the tightest band (a fraction; the HPA metric)."""
    if not engines:
        return 0.0
    rps = [band_capacity(e.model, mix, ttft_s, tpot_s, z, e.block_size, e.num_blocks)
           ["requests_per_s"] for e in engines]
    mean = sum(rps) / len(rps)  # type: ignore[arg-type]
    return rate / mean if mean > 0 else float(len(engines))


class MixTracker:
    """EWMA of the request mix (prompt, uncached prompt and output tokens) of the
    requests an engine finished.

    Args:
        alpha: weight of each new request (default 0.02: about the last 50).
    """

    def __init__(self, alpha: float = 0.02) -> None:
        self._alpha = alpha
        self._mix: list[float] | None = None

    def observe(self, prompt_tokens: int, uncached_tokens: int, output_tokens: int) -> None:
        x = [float(prompt_tokens), float(uncached_tokens), float(output_tokens)]
        if self._mix is None:
            self._mix = x
        else:
            self._mix = [m + self._alpha * (v - m) for m, v in zip(self._mix, x, strict=True)]

    def mix(self) -> Mix | None:
        """The current mix, or None before any request."""
        return Mix(*self._mix) if self._mix is not None else None
