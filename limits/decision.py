"""The pure admission rules over one engine's fitted latency model: :func:`decide`,
whether the engine may take one more request, and :func:`best_effort_wait_s`, how
long a request served only at best effort may wait in the queue. The ledger that
applies them is :class:`limits.engine_latency.EngineLatency`; the rules and their
sources are in ``docs/adaptive-admission.md``, "The decision".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from limits.latency_model import LatencyModel, Prediction


@dataclass(frozen=True)
class Verdict:
    """:func:`decide`'s answer: ``admit``, the predictions it used (s) and, when
    refused, ``reason`` (``ttft`` or ``tpot``); ``best_effort`` when admitted at best
    effort (:meth:`limits.engine_latency.EngineLatency.best_effort`)."""

    admit: bool
    ttft: Prediction
    tpot: Prediction | None
    reason: str | None = None
    best_effort: bool = False


def decide(model: LatencyModel, *, uncached_tokens: int, pending_prefill_tokens: int,
           decoding: int, in_flight: int, ttft_budget_s: float, tpot_target_s: float,
           tightest_running_tpot_s: float | None, z: float, limit: float | None = None,
           reserve: float = 0.0, sustained: float | None = None,
           best_effort: bool = False, elsewhere: bool = True,
           ttft_target_s: float | None = None) -> Verdict:
    """Whether an engine takes a request (rules: docs/adaptive-admission.md, "The decision").

    Args:
        model: the engine's fitted model.
        uncached_tokens: the request's prompt tokens the engine must compute.
        pending_prefill_tokens: uncached tokens of requests on the engine that have
            not had their first token.
        decoding: requests on the engine past their first token.
        in_flight: all requests on the engine.
        ttft_budget_s: the request's TTFT target less the time it already waited, s.
        tpot_target_s: the request's TPOT target, s.
        tightest_running_tpot_s: smallest TPOT target among requests in flight there,
            s (None when none).
        z: standard deviations added to predictions (conservatism).
        limit: when given, the fallback concurrency limit replaces the TPOT rule; at
            best effort, the throughput knee (:meth:`LatencyModel.throughput_knee`):
            the engine takes the request only while fewer are in flight.
        reserve: requests of more urgent bands expected on this engine that are not
            there yet (:class:`BandDemand`); the TPOT rule keeps room for them on top
            of this request.
        sustained: the engine's expected requests in service in the long run (every
            band's occupancy, :meth:`BandDemand.occupancy`, per engine); None: no
            burst rule.
        best_effort: the engine serves the request's TPOT target at best effort
            (:meth:`limits.engine_latency.EngineLatency.best_effort`): rule 1 decides, on TTFT̂'s mean
            while the TTFT fit is not trusted, and only when ``elsewhere``; then
            ``limit`` (the throughput knee) instead of the TPOT rule.
        elsewhere: another engine may serve the request within its SLO (else, at
            best effort, holding it back would only move its wait from this engine's
            queue to the gateway's: docs/adaptive-admission.md, "Best effort").
        ttft_target_s: the request's band's TTFT target, s; a request late even with
            no prefill queued is held by rule 1 only while the engine's decoding
            alone makes it miss this target (None: never held for being late).
    """
    ttft = model.predict_ttft(pending_prefill_tokens + uncached_tokens, decoding)
    alone = model.predict_ttft(uncached_tokens, decoding)  # no prefill queued ahead
    # an untrusted TTFT fit judges only at best effort, and on its mean
    ttft_z = z if model.ttft_trusted else 0.0
    judge = elsewhere if best_effort else model.ttft_trusted
    # late even with no prefill queued: waiting cannot help it when it has used up
    # its slack (alone within the target) or its prompt is too long for the target
    # even on an idle engine, so rule 1 does not hold it; it still waits for no
    # prefill queued ahead where the engine's decoding alone makes it miss the target
    # (more requests there would only make that worse), and at best effort, where
    # another engine may serve it in time (``elsewhere``)
    late = alone.upper(ttft_z) > ttft_budget_s
    waited_out = late and (ttft_target_s is None or alone.upper(ttft_z) <= ttft_target_s
                           or model.predict_ttft(uncached_tokens, 0).upper(ttft_z)
                           > ttft_target_s)
    if (judge and (best_effort or not waited_out)
            and ttft.upper(ttft_z) > max(ttft_budget_s, alone.upper(ttft_z))):
        return Verdict(False, ttft, None, "ttft")
    if best_effort:  # the throughput knee, when given, caps the engine
        ok = limit is None or in_flight == 0 or in_flight < math.floor(limit)
        return Verdict(ok, ttft, None, None if ok else "throughput", best_effort=ok)
    if in_flight == 0:
        return Verdict(True, ttft, None)
    if limit is not None:
        ok = in_flight + reserve < math.floor(limit)
        return Verdict(ok, ttft, None, None if ok else "tpot")
    target = min(tpot_target_s, tightest_running_tpot_s or math.inf)
    tpot = model.predict_tpot(in_flight + 1 + reserve)
    ok = tpot.upper(z) <= target
    if not ok and sustained is not None:  # a burst over a load the knee holds
        ok = (model.predict_tpot(max(1.0, sustained)).upper(z) <= target
              and model.predict_tpot(in_flight + 1).mean <= target)
    return Verdict(ok, ttft, tpot, None if ok else "tpot")


#: Shortest queue wait allowed at best effort, s (:func:`best_effort_wait_s`): a
#: burst arriving together is not refused for the drain of a few requests.
MIN_BEST_EFFORT_WAIT_S = 1.0


def best_effort_wait_s(max_wait_s: float, service_s: float) -> float | None:
    """The longest wait in the gateway's queue for a request that every engine serves
    at best effort (held at its throughput knee), whose queue deadline is
    ``max_wait_s`` away (s: the tenant's ``max_queue_wait_s``, the queue's default or
    the client's ``x-request-timeout``): that deadline less its band's mean time on an
    engine ``service_s`` (s, :meth:`BandDemand.service_s`), at least
    :data:`MIN_BEST_EFFORT_WAIT_S` and at most ``max_wait_s``; None while
    ``service_s`` is 0 (not yet timed).

    Rule: no SLO holds there, so the deadline is read as the time to the answer: a
    request admitted after waiting longer than the rest would end past it, so the
    queue refuses it at once, with ``Retry-After`` from its drain rate
    (:mod:`limits.admission`), rather than let it wait and then run past the client's
    patience (seen on the simulated CPU engine with the shipped 30 s queue wait and a
    60 s client timeout, both a tenth in time: requests that waited the whole queue
    deadline then took 3 s more on the engine and timed out at the client)."""
    if service_s <= 0:
        return None
    return min(max_wait_s, max(MIN_BEST_EFFORT_WAIT_S, max_wait_s - service_s))
