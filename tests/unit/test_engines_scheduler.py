"""Scheduler shape: built-in filter, configured filters with fallback, weighted
scorers, picker; the plugin registry."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from pydantic import ValidationError

from config import plugins as config_plugins
from config.plugins import NoParams
from config.schema import FilterConfig, SchedulerConfig, ScorerConfig
from engines import plugins
from engines.plugins import (
    LeastInFlight,
    LoadGuard,
    MaxScore,
    build_filter,
    build_picker,
    build_scorer,
)
from engines.pool import Engine, EngineState
from engines.scheduler import Decision, SchedRequest, Scheduler

REQ = SchedRequest(model="m", tenant="t", prompt_tokens=10)


def eng(id_: str, in_flight: int = 0, state: EngineState = EngineState.READY,
        model: str = "m") -> Engine:
    return Engine(id=id_, model=model, base_url=f"http://{id_}", state=state,
                  in_flight=in_flight)


def test_least_in_flight_scores() -> None:
    es = [eng("a", 0), eng("b", 2), eng("c", 4)]
    assert LeastInFlight().score(REQ, es, 0) == [1.0, 0.5, 0.0]
    assert LeastInFlight().score(REQ, [eng("a"), eng("b")], 0) == [1.0, 1.0]


def test_max_score_breaks_ties_at_random() -> None:
    picker = MaxScore(random.Random(1))
    es = [eng("a"), eng("b"), eng("c")]
    assert picker.pick(es, [0.2, 0.9, 0.1]) == 1
    assert {picker.pick(es, [0.5, 0.5, 0.1]) for _ in range(50)} == {0, 1}


def test_only_ready_engines_of_the_model() -> None:
    s = Scheduler(SchedulerConfig(), random.Random(0))
    es = [eng("down", state=EngineState.STARTING), eng("other", model="x"),
          eng("draining", state=EngineState.DRAINING), eng("ok", in_flight=9)]
    d = s.pick(REQ, es, 0)
    assert isinstance(d, Decision) and d.engine.id == "ok"
    assert s.pick(SchedRequest(model="nope", tenant="t", prompt_tokens=1), es, 0) is None
    assert s.pick(REQ, es[:3], 0) is None


def test_least_loaded_engine_wins_and_scores_are_reported() -> None:
    s = Scheduler(SchedulerConfig(scorers=[ScorerConfig(type="least-in-flight", weight=2)]))
    d = s.pick(REQ, [eng("a", 3), eng("b", 1), eng("c", 2)], 0)
    assert d is not None and d.engine.id == "b"
    assert d.scores == {"least-in-flight": pytest.approx(2 / 3), "total": pytest.approx(4 / 3)}


class _DropAll:
    Params = plugins.NoParams

    def filter(self, req: SchedRequest, engines: Sequence[Engine], now: float) -> list[Engine]:
        return []


class _OnlyB:
    Params = plugins.NoParams

    def filter(self, req: SchedRequest, engines: Sequence[Engine], now: float) -> list[Engine]:
        return [e for e in engines if e.id == "b"]


def test_configured_filters_narrow_and_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugins, "FILTERS", {"drop-all": _DropAll, "only-b": _OnlyB})
    monkeypatch.setattr(config_plugins, "PLUGIN_PARAMS", {  # the schema's side of the registry
        **config_plugins.PLUGIN_PARAMS, "filter": {"drop-all": NoParams, "only-b": NoParams}})
    es = [eng("a", 0), eng("b", 5)]
    narrow = Scheduler(SchedulerConfig(filters=[FilterConfig(type="only-b")]))
    assert narrow.pick(REQ, es, 0).engine.id == "b"
    fallback = Scheduler(SchedulerConfig(filters=[FilterConfig(type="drop-all")]))
    assert fallback.pick(REQ, es, 0).engine.id == "a"  # healthy list, least in flight


def test_unknown_type_is_a_config_error_at_type_listing_the_valid_ones() -> None:
    with pytest.raises(ValidationError) as err:
        SchedulerConfig.model_validate({"scorers": [{"type": "queue-depth"}, {"type": "nope"}],
                                        "filters": [{"type": "kv-x"}],
                                        "picker": {"type": "first"}})
    got = {".".join(map(str, e["loc"])): e["msg"] for e in err.value.errors()}
    assert set(got) == {"scorers.1.type", "filters.0.type", "picker.type"}
    assert "unknown scorer type 'nope'; valid types: kv-cache-usage, least-in-flight, " \
        "predicted-ttft, prefill-backlog, prefix-affinity, queue-depth, session-affinity" \
        in got["scorers.1.type"]
    assert "unknown filter type 'kv-x'; valid types: kv-watermark, load-guard" in got["filters.0.type"]
    assert "unknown picker type 'first'" in got["picker.type"]


def test_params_are_typed_per_plugin() -> None:
    with pytest.raises(ValidationError) as err:
        SchedulerConfig.model_validate({
            "scorers": [{"type": "least-in-flight", "params": {"x": 1}}],
            "filters": [{"type": "kv-watermark", "params": {"watermark": 1.5}},
                        {"type": "load-guard", "params": {"abs_threshold": "many"}}],
            "picker": {"type": "max-score", "weight": 2}})
    got = {".".join(map(str, e["loc"])): e["type"] for e in err.value.errors()}
    assert got == {"scorers.0.params.x": "extra_forbidden",
                   "filters.0.params.watermark": "less_than_equal",
                   "filters.1.params.abs_threshold": "float_parsing",
                   "picker.weight": "extra_forbidden"}  # weight belongs to scorers
    cfg = SchedulerConfig.model_validate(
        {"filters": [{"type": "load-guard", "params": {"abs_threshold": 2}}],
         "picker": {"type": "max-score", "params": {"tolerance": 0.1}}})
    assert cfg.filters[0].params == {"abs_threshold": 2.0, "rel_threshold": 0.25}
    guard = build_filter(cfg.filters[0])
    assert isinstance(guard, LoadGuard) and (guard.abs_threshold, guard.rel_threshold) == (2, 0.25)
    picker = build_picker(cfg.picker, random.Random())
    assert isinstance(picker, MaxScore) and picker.tolerance == 0.1
    with pytest.raises(ValueError, match="unknown scorer type 'nope'"):
        build_scorer(ScorerConfig.model_construct(type="nope", params={}, weight=1.0))


def test_registries_are_immutable() -> None:
    with pytest.raises(TypeError):
        plugins.SCORERS["x"] = LeastInFlight  # type: ignore[index]
