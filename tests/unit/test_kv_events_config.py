"""Configuration of KV events: external engines declare their publisher, launched
ones get ``--kv-events-config`` with private ``ipc://`` sockets, the simulator parses vLLM's flag."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from pydantic import ValidationError

from config.schema import EnginesConfig, EngineSpec
from engines.supervisor import REPLAY_BUFFER_STEPS, kv_events_flag, private_socket_dir
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


def test_launch_flag_puts_both_sockets_in_a_private_folder() -> None:
    """Issue 39 item 13: the events carry the prompts' token ids, so a launched
    engine's publisher is an ``ipc://`` socket in a 0700 folder, never ``tcp://*``
    (which vLLM binds on every interface)."""
    sock_dir = private_socket_dir()
    try:
        assert stat.S_IMODE(sock_dir.stat().st_mode) == 0o700
        endpoint, argv = kv_events_flag("sim-0", sock_dir)
        assert argv[0] == "--kv-events-config"
        flag = json.loads(argv[1])
        for url in (flag["endpoint"], flag["replay_endpoint"]):
            assert url.startswith("ipc://") and Path(url[6:]).parent == sock_dir
            assert len(url[6:].encode()) < 108  # a Unix socket path's limit
        assert flag["endpoint"] != flag["replay_endpoint"]
        assert endpoint.endpoint == flag["endpoint"] and endpoint.replay == flag["replay_endpoint"]
        assert flag["buffer_steps"] == REPLAY_BUFFER_STEPS and flag["topic"] == "kv@sim-0"
        other, _ = kv_events_flag("sim-1", sock_dir)  # one pair of sockets per engine
        assert other.endpoint != endpoint.endpoint and other.replay != endpoint.replay
        assert kv_events_flag("x" * 64, sock_dir)[0].endpoint.startswith(f"ipc://{sock_dir}/")
    finally:
        sock_dir.rmdir()
    parsed = KVEventsConfig.from_json(argv[1])
    assert parsed.enabled and parsed.buffer_steps == REPLAY_BUFFER_STEPS
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false}').enabled
    with pytest.raises(ValueError):
        KVEventsConfig.from_json("[1]")
