"""Configuration of KV events: external engines declare their publisher, launched
ones get ``--kv-events-config`` with free ports, the simulator parses vLLM's flag."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from config.schema import EnginesConfig, EngineSpec
from engines.supervisor import REPLAY_BUFFER_STEPS, kv_events_flag
from loadtest.sim_engine.kv_events import KVEventsConfig


def test_external_engines_declare_their_publisher():
    spec = EngineSpec.model_validate({
        "name": "x", "model": "m", "kind": "external", "url": "http://h:8000",
        "kv_events": {"endpoint": "tcp://h:5557", "replay_endpoint": "tcp://h:5558"}})
    assert spec.kv_events.endpoint == "tcp://h:5557" and spec.kv_events.topic == ""
    with pytest.raises(ValidationError, match="kv_events is for external engines"):
        EngineSpec.model_validate({"name": "s", "model": "m", "kind": "sim",
                                   "kv_events": {"endpoint": "tcp://h:1"}})
    with pytest.raises(ValidationError):
        EngineSpec.model_validate({"name": "x", "model": "m", "kind": "external",
                                   "url": "http://h", "kv_events": {"endpoint": "h:1"}})
    cfg = EnginesConfig.model_validate({"scheduler": {"prefix": {"source": "events"}}})
    assert cfg.scheduler.prefix.source == "events"
    with pytest.raises(ValidationError):
        EnginesConfig.model_validate({"scheduler": {"prefix": {"source": "exact"}}})


def test_launch_flag_has_two_new_free_ports():
    taken = {1234}
    endpoint, argv = kv_events_flag("sim-0", "0.0.0.0", taken)
    assert argv[0] == "--kv-events-config"
    flag = json.loads(argv[1])
    pub, replay = int(flag["endpoint"].rsplit(":", 1)[1]), int(
        flag["replay_endpoint"].rsplit(":", 1)[1])
    assert flag["endpoint"] == f"tcp://*:{pub}" and pub != replay and {pub, replay} < taken
    assert flag["buffer_steps"] == REPLAY_BUFFER_STEPS and flag["topic"] == "kv@sim-0"
    assert endpoint.endpoint == f"tcp://127.0.0.1:{pub}"  # a wildcard host is reached locally
    assert endpoint.replay == flag["replay_endpoint"] == f"tcp://127.0.0.1:{replay}"
    parsed = KVEventsConfig.from_json(argv[1])
    assert parsed.enabled and parsed.buffer_steps == REPLAY_BUFFER_STEPS
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false}').enabled
    with pytest.raises(ValueError):
        KVEventsConfig.from_json("[1]")
