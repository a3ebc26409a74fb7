"""What a benchmark's config changes from the shipped one (loadtest.changed), and
that every benchmark config writer gives a reason for each change."""

from __future__ import annotations

import os

import pytest
import yaml

from loadtest import overload
from loadtest.adaptive import adaptive_config
from loadtest.changed import changed_settings, shipped
from loadtest.replay import POLICIES, SIM_CONFIG_REASONS, write_sim_config


def _write(folder, gateway: dict, engines: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    fleet = {"engines": [{"name": "e", "model": "m", "kind": "external",
                          "url": "http://127.0.0.1:1"}]}
    (folder / "gateway.yaml").write_text(yaml.safe_dump(gateway))
    (folder / "engines.yaml").write_text(yaml.safe_dump({**fleet, **engines}))


def test_a_changed_setting_is_reported_with_its_shipped_value_and_reason(tmp_path) -> None:
    interval = shipped("engines")["supervisor"]["metrics_interval_s"]
    _write(tmp_path, {"cache": {"enabled": False}},
           {"supervisor": {"metrics_interval_s": interval / 4,
                           "probe_interval_s": shipped("engines")["supervisor"]["probe_interval_s"]},
            "saturation": {}})
    out = changed_settings(tmp_path, {"gateway.cache": "unique prompts",
                                      "engines.supervisor.metrics_interval_s": "short runs"})
    assert out == {
        "gateway.cache.enabled": {"value": False, "shipped": True, "why": "unique prompts"},
        "engines.supervisor.metrics_interval_s": {"value": interval / 4, "shipped": interval,
                                                  "why": "short runs"},
    }  # the shipped probe interval and the empty section are no change; the fleet is not compared


def test_a_change_without_a_reason_is_refused(tmp_path) -> None:
    _write(tmp_path, {}, {"saturation": {"max_waiting": 100}})
    with pytest.raises(KeyError, match="engines.saturation.max_waiting = 100"):
        changed_settings(tmp_path, {"engines.supervisor": "not this section"})


def test_a_plugin_list_compares_with_its_defaults_filled_in(tmp_path) -> None:
    scheduler = shipped("engines")["scheduler"]
    bare = {**scheduler, "scorers": [{"type": s["type"], "weight": s["weight"]}
                                     for s in scheduler["scorers"]]}
    _write(tmp_path, {}, {"scheduler": bare})
    assert changed_settings(tmp_path, {}) == {}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_routing_benchmark_gives_a_reason_for_each_change(tmp_path, policy) -> None:
    folder = write_sim_config(tmp_path, 4, policy, "sim-model", [], 256 << 20)
    out = changed_settings(folder, SIM_CONFIG_REASONS)
    assert out["engines.saturation.max_waiting"]["value"] == 100_000
    assert out["engines.saturation.max_waiting"]["shipped"] == \
        shipped("engines")["saturation"]["max_waiting"]
    assert ("engines.scheduler.picker.type" in out) == (policy == "round-robin")


def test_the_overload_harness_gives_a_reason_for_each_change(tmp_path) -> None:
    args = overload.parse_args(["--json", os.devnull])
    report: dict = {"config": {"changed": {}}}
    adaptive_config(tmp_path / "a", ["http://127.0.0.1:1"], args, report)
    out = report["config"]["changed"]
    assert out == changed_settings(tmp_path / "a", overload.HARNESS_REASONS)
    assert not any(k.startswith("engines.saturation") for k in out)  # the shipped admission
    assert out["gateway.slo.batch.ttft_s"]["value"] == 1.0
    static = overload.write_gateway_config(tmp_path / "s", ["http://127.0.0.1:1"], args,
                                           {"max_in_flight": 8, "adaptive": {"enabled": False}})
    out = changed_settings(static, overload.HARNESS_REASONS)
    assert out["engines.saturation.max_in_flight"]["value"] == 8
    assert out["engines.saturation.adaptive.enabled"] == {
        "value": False, "shipped": True, "why": overload.HARNESS_REASONS[
            "engines.saturation.adaptive.enabled"]}
