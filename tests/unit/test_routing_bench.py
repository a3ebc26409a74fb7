"""The routing benchmark's generated gateway config and ideal hit rate
(loadtest.replay --engines/--policy)."""

from __future__ import annotations

import pytest

from config.loader import load_config
from engines.scheduler import Scheduler
from loadtest.replay import POLICIES, replayed_ideal_hit_rate, write_sim_config
from loadtest.workloads.base import WorkloadOptions
from loadtest.workloads.mooncake import trace_path


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_generated_config_loads_and_builds_the_policy(tmp_path, policy) -> None:
    folder = write_sim_config(tmp_path, 4, policy, "sim-model",
                              ["--profile", "h200-llama3-8b"], 256 << 20)
    cfg = load_config(directory=folder)
    assert cfg.engines.engines[0].replicas == 4 and cfg.engines.engines[0].kind == "sim"
    assert cfg.engines.scheduler.prefix.max_bytes == 256 << 20
    Scheduler(cfg.engines.scheduler)


@pytest.mark.skipif(not trace_path().exists(), reason="Mooncake trace not present")
def test_ideal_hit_rate_of_the_replayed_part() -> None:
    assert replayed_ideal_hit_rate("mooncake-conversation", WorkloadOptions()) == \
        pytest.approx(0.374, abs=0.001)
    part = replayed_ideal_hit_rate("mooncake-conversation", WorkloadOptions(limit=1000))
    assert 0.1 < part < 0.374
    assert replayed_ideal_hit_rate("short", WorkloadOptions()) is None
