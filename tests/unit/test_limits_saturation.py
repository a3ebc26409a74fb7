"""SaturationDetector: one test per rule."""

from __future__ import annotations

from dataclasses import dataclass, replace

from config.schema import EnginesConfig
from limits.saturation import SaturationDetector, kv_blocks


@dataclass(frozen=True)
class Load:
    kv_cache_usage: float | None = 0.5
    num_waiting: int = 0
    block_size: int | None = 16
    num_blocks: int | None = 1000
    promised_blocks: int = 0
    in_flight: int = 0
    metrics_at: float | None = 100.0
    metered: bool = True
    slots: int | None = None
    unreported: int = 0


NOW = 101.0
detector = SaturationDetector(watermark=0.9, batch_watermark=0.8, max_waiting=4, stale_s=5)


def test_idle_engine_admits() -> None:
    assert detector.admits(Load(), "interactive", 100, NOW)


def test_missing_or_stale_metrics_count_as_saturated() -> None:
    assert not detector.admits(Load(metrics_at=None), "interactive", 1, NOW)
    assert not detector.admits(Load(metrics_at=NOW - 5.01), "interactive", 1, NOW)
    assert detector.admits(Load(metrics_at=NOW - 5), "interactive", 1, NOW)



def test_engine_without_kv_usage_is_admitted_by_in_flight_count() -> None:
    """llama.cpp and TGI report no KV usage: the gateway's own count decides (default
    cap 4), their waiting queue still counts; an unmetered engine (no /metrics) needs
    no fresh metrics at all, a metered one with stale metrics stays saturated."""
    no_kv = Load(kv_cache_usage=None, block_size=None, num_blocks=None)
    assert detector.admits(replace(no_kv, in_flight=3), "standard", 10_000, NOW)
    assert not detector.admits(replace(no_kv, in_flight=4), "interactive", 1, NOW)
    assert not detector.admits(replace(no_kv, num_waiting=5), "interactive", 1, NOW)
    unmetered = replace(no_kv, metrics_at=None, metered=False)
    assert detector.admits(replace(unmetered, in_flight=3), "batch", 1, NOW)
    assert not detector.admits(replace(unmetered, in_flight=4), "interactive", 1, NOW)
    assert not detector.admits(replace(no_kv, metrics_at=None), "interactive", 1, NOW)
    capped = SaturationDetector(max_in_flight=2, unmetered_max_in_flight=8)
    assert not capped.admits(replace(unmetered, in_flight=2), "interactive", 1, NOW)


def test_learned_admission_sets_no_fixed_cap_on_an_engine_without_kv_usage() -> None:
    """With adaptive admission the learned limit (applied by placement) decides: no
    fixed cap here, but the engine's waiting queue, stale metrics of a metered engine
    and a configured max_in_flight still count."""
    learned = SaturationDetector(learned=True)
    no_kv = Load(kv_cache_usage=None, block_size=None, num_blocks=None)
    assert learned.admits(replace(no_kv, in_flight=40), "interactive", 1, NOW)
    assert learned.admits(replace(no_kv, in_flight=40, metrics_at=None, metered=False),
                          "batch", 1, NOW)
    assert not learned.admits(replace(no_kv, num_waiting=5), "interactive", 1, NOW)
    assert not learned.admits(replace(no_kv, metrics_at=None), "interactive", 1, NOW)
    capped = SaturationDetector(learned=True, max_in_flight=6)
    assert not capped.admits(replace(no_kv, in_flight=6), "interactive", 1, NOW)
    cfg = EnginesConfig.model_validate({"engines": []})
    assert SaturationDetector.from_config(cfg).learned  # adaptive admission is shipped on


def test_reported_slots_are_a_hard_cap() -> None:
    """An engine that reports a fixed slot count (llama.cpp) never gets more of this
    gateway's requests than it has slots, learned limit or not, KV usage or not."""
    no_kv = Load(kv_cache_usage=None, block_size=None, num_blocks=None, slots=2)
    for d in (SaturationDetector(learned=True), detector):
        assert d.admits(replace(no_kv, in_flight=1), "interactive", 1, NOW)
        assert not d.admits(replace(no_kv, in_flight=2), "interactive", 1, NOW)
    assert not detector.admits(Load(slots=3, in_flight=3), "interactive", 1, NOW)


def test_kv_watermark() -> None:
    assert detector.admits(Load(kv_cache_usage=0.89), "standard", 1, NOW)
    assert not detector.admits(Load(kv_cache_usage=0.9), "standard", 1, NOW)
    assert not detector.admits(Load(kv_cache_usage=0.9), "interactive", 1, NOW)


def test_batch_only_under_the_lower_watermark() -> None:
    assert detector.admits(Load(kv_cache_usage=0.79), "batch", 1, NOW)
    assert not detector.admits(Load(kv_cache_usage=0.8), "batch", 1, NOW)
    assert detector.admits(Load(kv_cache_usage=0.85), "interactive", 1, NOW)


def test_waiting_requests_threshold() -> None:
    assert detector.admits(Load(num_waiting=4), "interactive", 1, NOW)
    assert not detector.admits(Load(num_waiting=5), "interactive", 1, NOW)


def test_blocks_must_fit_free_minus_promised() -> None:
    assert kv_blocks(1600, 16) == 100 and kv_blocks(1601, 16) == 101
    assert kv_blocks(1000, None) == 0
    # 1000 blocks at 50 % usage: 500 free, 400 promised → 100 left
    load = Load(promised_blocks=400)
    assert detector.admits(load, "interactive", 1600, NOW)
    assert not detector.admits(load, "interactive", 1601, NOW)
    # batch counts only up to its watermark: 1000 × (0.8 − 0.5) − 200 = 100
    load = Load(promised_blocks=200)
    assert detector.admits(load, "batch", 1600, NOW)
    assert not detector.admits(load, "batch", 1601, NOW)


def test_unknown_cache_geometry_skips_the_block_budget() -> None:
    load = Load(block_size=None, num_blocks=None, promised_blocks=10**6)
    assert detector.admits(load, "interactive", 10**6, NOW)


def test_in_flight_cap() -> None:
    capped = SaturationDetector(max_in_flight=3)
    assert capped.admits(Load(in_flight=2), "interactive", 1, NOW)
    assert not capped.admits(Load(in_flight=3), "interactive", 1, NOW)
    assert detector.admits(Load(in_flight=10**6), "interactive", 1, NOW)  # no cap by default


def test_interactive_reserve() -> None:
    d = SaturationDetector(max_in_flight=4, interactive_reserve=1)
    assert d.admits(Load(in_flight=3), "interactive", 1, NOW)
    assert not d.admits(Load(in_flight=3), "standard", 1, NOW)
    assert not d.admits(Load(in_flight=3), "batch", 1, NOW)
    assert d.admits(Load(in_flight=2), "batch", 1, NOW)


def test_from_config() -> None:
    cfg = EnginesConfig.model_validate({
        "saturation": {"kv_watermark": 0.95, "batch_kv_watermark": 0.7, "max_waiting": 0,
                       "max_in_flight": 8},
        "supervisor": {"metrics_stale_s": 2},
    })
    d = SaturationDetector.from_config(cfg)
    assert (d.watermark, d.batch_watermark, d.max_waiting, d.stale_s, d.max_in_flight) == (
        0.95, 0.7, 0, 2, 8)
    assert not d.admits(replace(Load(), num_waiting=1), "interactive", 1, NOW)
