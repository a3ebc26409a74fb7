"""The Batch API's small rules: completion windows, the tenant a batch line runs as,
a batch's lines/s estimate, the internal secret."""

from __future__ import annotations

import asyncio

import pytest

from config.schema import AdaptiveConfig, BatchConfig, QueueConfig, SloConfig, TenantQuota
from engines.pool import Engine, EnginePool, EngineState
from gateway.batch_api import window_s
from gateway.batch_runner import BatchRunner, _Rate
from gateway.internal import batch_tenant, internal_secret, is_internal
from limits.admission import AdmissionQueue
from limits.latency_model import LatencyPrior
from limits.outcome import Rejected
from limits.slo_gate import SloGate
from tests.support import ManualClock


@pytest.mark.parametrize(("value", "seconds"), [("24h", 86400), ("90m", 5400), ("3s", 3),
                                                ("7d", 604800)])
def test_completion_windows_in_whole_units(value: str, seconds: float) -> None:
    assert window_s(value, 7 * 86400) == seconds


@pytest.mark.parametrize("value", ["", "24", "h", "0h", "1.5h", "-1h", "8d", "24 h", "1w"])
def test_bad_or_too_long_windows_are_400s(value: str) -> None:
    with pytest.raises(Rejected) as e:
        window_s(value, 7 * 86400)
    assert e.value.outcome.status == 400 and e.value.param == "completion_window"


def test_a_batch_line_runs_in_the_batch_band_under_the_tenants_quota() -> None:
    cfg = BatchConfig(max_queue_wait_s=123)
    t = TenantQuota(name="acme", priority="interactive", tokens_per_min=1000,
                    requests_per_min=10, max_queue_wait_s=1)
    line = batch_tenant(t, cfg)
    assert (line.name, line.priority, line.tokens_per_min, line.requests_per_min,
            line.max_queue_wait_s) == ("acme", "batch", 1000, 10, 123)


def test_batch_tokens_per_min_is_a_budget_of_its_own() -> None:
    t = TenantQuota(name="acme", tokens_per_min=1000, requests_per_min=10,
                    batch_tokens_per_min=50_000)
    line = batch_tenant(t, BatchConfig())
    assert (line.name, line.tokens_per_min, line.requests_per_min) == ("acme:batch", 50_000, None)
    assert line.namespace == t.namespace  # the same cache and prefix namespace


def test_lines_per_second_follows_the_finished_lines() -> None:
    rate = _Rate(done=0, at=0.0)
    for t in range(1, 121):
        rate.update(done=5 * t, at=float(t))
    assert rate.per_s == pytest.approx(5.0, rel=0.01)
    rate.update(done=600, at=150.0)  # nothing finished for 30 s
    assert rate.per_s < 5 * 0.1


def test_the_internal_secret_is_stable_and_compared_exactly() -> None:
    secret = internal_secret()
    assert internal_secret() == secret and len(secret) == 32
    assert is_internal(secret)
    assert not is_internal(secret[:-1]) and not is_internal(None) and not is_internal("")


def _runner(engines: list[Engine], queue: AdmissionQueue, **cfg: float) -> BatchRunner:
    return BatchRunner(None, BatchConfig(**cfg), None, {"m": queue},  # type: ignore[arg-type]
                       EnginePool(engines), None, SloConfig())


def _engine(name: str, in_flight: int, slots: int | None = 8) -> Engine:
    return Engine(id=name, model="m", base_url="http://x", state=EngineState.READY,
                  in_flight=in_flight, slots=slots)


async def test_lines_are_sent_only_into_room_left_below_the_limits_less_the_headroom() -> None:
    queue: AdmissionQueue = AdmissionQueue("m", QueueConfig(), ManualClock())
    engines = [_engine("a", 3), _engine("b", 2), _engine("down", 0)]  # adaptive off: slots
    engines[2].state = EngineState.UNHEALTHY
    runner = _runner(engines, queue, headroom=0.25, queued_lines=4)
    # 16 places (two ready engines x 8 slots), 4 kept, 5 taken: 7 free, 4 at most queued
    assert runner.room("m") == 4
    runner = _runner(engines, queue, headroom=0.25, queued_lines=20)
    assert runner.room("m") == 7
    engines[0].in_flight = 12
    assert runner.room("m") == 0  # the online requests took the room: no new line
    assert runner.room("unserved") == 1  # answered 404 by the gateway, as it should be
    # no learned limit, no slots, no cap: batch.max_in_flight (the KV watermarks decide)
    runner = _runner([_engine("c", 0, slots=None)], queue, headroom=0.5, queued_lines=100,
                     max_in_flight=40)
    assert runner.room("m") == 20


async def test_lines_give_way_while_an_online_request_waits() -> None:
    clock = ManualClock()
    queue: AdmissionQueue = AdmissionQueue("m", QueueConfig(), clock)
    runner = _runner([_engine("a", 0)], queue, headroom=0.0, queued_lines=8)
    assert runner.room("m") == 8
    batch = asyncio.create_task(queue.admit(
        queue.ticket(TenantQuota(name="t", priority="batch"), 10), lambda _t: None,
        lambda _p: None))
    await asyncio.sleep(0)
    assert queue.depth()["batch"] == 1 and runner.room("m") == 7  # one place is its
    online = asyncio.create_task(queue.admit(
        queue.ticket(TenantQuota(name="u", priority="standard"), 10), lambda _t: None,
        lambda _p: None))
    await asyncio.sleep(0)
    assert runner.room("m") == 0
    for task in (batch, online):
        task.cancel()
    await asyncio.gather(batch, online, return_exceptions=True)
    queue.close()


async def test_a_line_goes_where_an_online_request_after_it_still_starts_in_time() -> None:
    """An engine takes a batch line while an interactive request of the model's typical
    prompt, sent right after the line (whose prefill runs first on an FCFS engine),
    is predicted to start within the interactive TTFT target (1 s)."""
    clock = ManualClock()
    queue: AdmissionQueue = AdmissionQueue("m", QueueConfig(), clock)
    gate = SloGate(adaptive=AdaptiveConfig(), clock=clock)
    engines = [_engine("idle", 0), _engine("busy", 0)]
    for e in engines:
        gate.track(e.id)
        lat = gate.ledger(e.id)
        assert lat is not None
        # TTFT 50 ms + 1 ms per prefill token ahead, no noise, trusted at once
        lat.model.__init__(LatencyPrior(ttft_overhead_s=0.05, prefill_s_per_token=0.001,
                                        rel_std=1e-6), min_samples=0)
    runner = BatchRunner(None, BatchConfig(queued_lines=10), None,  # type: ignore[arg-type]
                         {"m": queue}, EnginePool(engines), None, SloConfig(), gate=gate)
    typical = 400
    # idle: 50 ms + 2 x 400 tokens = 0.85 s (one prompt alone, 0.45 s, is not within
    # half the target, which a line needed before); 2 x 512 tokens: 1.074 s
    assert runner._online_starts_after_a_line(engines[0], typical) is True
    assert runner._online_starts_after_a_line(engines[0], 512) is False
    # 300 tokens of prefill pending on "busy": 0.05 + 0.3 + 0.8 = 1.15 s
    gate.ledger("busy").pending_prefill_tokens = 300  # type: ignore[union-attr]
    assert runner._online_starts_after_a_line(engines[1], typical) is False
    # the lines sent follow: none while the model's mix is unseen (512 tokens
    # assumed), then one (the idle engine), then two
    assert runner.room("m") == 0
    runner._prompt_tokens = lambda _m: typical  # type: ignore[method-assign]
    assert runner.room("m") == 1
    gate.ledger("busy").pending_prefill_tokens = 0  # type: ignore[union-attr]
    assert runner.room("m") == 2
