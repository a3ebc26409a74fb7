"""Pure pieces of the gateway: SSE framing, request parsing, auth, config errors."""

from __future__ import annotations

import json

import pytest

from config.loader import ConfigError, load_config, load_file
from config.schema import TenantsConfig
from gateway.auth import TenantDirectory, hash_key
from gateway.openai_api import output_cap, parse_json, parse_request
from gateway.proxy import retry_after_s
from gateway.sse import EventFramer, EventTooLarge, StreamSummary
from limits.outcome import Outcome, Rejected


def test_framer_never_splits_utf8_and_keeps_the_tail():
    text = "naïve 日本語 🚀"
    stream = b"".join(b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": w}}]},
                                              ensure_ascii=False).encode() + b"\n\n"
                      for w in text.split(" ")) + b"data: [DONE]\n\n"
    framer, events = EventFramer(1024), []
    for i in range(0, len(stream), 5):  # 5-byte reads cut characters apart
        events += framer.feed(stream[i:i + 5])
    assert framer.pending == b""
    summary = StreamSummary(chat=True)
    for e in events:
        summary.observe(e)
    assert summary.done and "".join(summary.texts[0]) == text.replace(" ", "")
    assert summary.content_chunks == 3


def test_framer_bounds_one_event_and_drops_it():
    framer = EventFramer(1024)
    assert framer.feed(b'data: {"a": 1}\n\ndata: {"x":"') == [b'data: {"a": 1}\n\n']
    assert framer.feed(b"y" * 1000) == []
    with pytest.raises(EventTooLarge):
        framer.feed(b"y" * 20)  # 12 + 1020 bytes, no end: past 1024
    assert framer.pending == b""
    with pytest.raises(EventTooLarge):  # a complete event past the bound, in one read
        framer.feed(b"data: " + b"z" * 2000 + b"\n\ndata: [DONE]\n\n")
    assert framer.feed(b"data: " + b"z" * 1000 + b"\n\n") == [b"data: " + b"z" * 1000 + b"\n\n"]


def test_retry_after_seconds_or_http_date():
    assert retry_after_s("7") == 7.0
    assert retry_after_s(None) is None and retry_after_s("soon") is None
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past


def test_summary_rebuilds_a_finished_answer_only():
    s = StreamSummary(chat=False)
    s.observe(b'data: {"id": "x", "created": 1, "model": "m", "choices": [{"index": 0, "text": "a"}]}\n\n')
    assert s.to_response() is None  # no finish reason yet
    s.observe(b'data: {"id": "x", "choices": [{"index": 0, "text": "b", "finish_reason": "stop"}]}\n\n')
    s.observe(b'data: {"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n')
    assert s.to_response() is None  # no [DONE]
    s.observe(b"data: [DONE]\n\n")
    r = s.to_response()
    assert r["choices"] == [{"index": 0, "text": "ab", "finish_reason": "stop"}]
    assert r["usage"]["completion_tokens"] == 2 and r["object"] == "text_completion"


def test_parse_request_output_fields():
    r = parse_request("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                               "max_completion_tokens": 50, "max_tokens": 70})
    assert r.max_output_tokens == 50 and r.output_field == "max_completion_tokens"
    r.set_output_cap(10)
    assert r.body["max_completion_tokens"] == 10 and "max_tokens" not in r.body
    r = parse_request("completions", {"model": "m", "prompt": [[1, 2, 3], [4]]})
    assert r.prompt_tokens == 4 and r.max_output_tokens is None and r.output_field == "max_tokens"


@pytest.mark.parametrize("endpoint,fields,field,cap", [
    # chat: max_completion_tokens wins when set (vLLM ChatCompletionRequest)
    ("chat", {"max_completion_tokens": 50, "max_tokens": 70}, "max_completion_tokens", 50),
    ("chat", {"max_completion_tokens": None, "max_tokens": 100}, "max_tokens", 100),
    ("chat", {"max_tokens": 100}, "max_tokens", 100),
    ("chat", {}, "max_tokens", None),
    # completions: vLLM reads max_tokens only
    ("completions", {"max_tokens": 3000, "max_completion_tokens": 1}, "max_tokens", 3000),
    ("completions", {"max_completion_tokens": 5}, "max_tokens", None),
    ("completions", {"max_tokens": None, "max_completion_tokens": 5}, "max_tokens", None),
])
def test_output_cap_is_the_field_the_engine_reads(endpoint, fields, field, cap):
    base = ({"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat"
            else {"prompt": "hi"})
    r = parse_request(endpoint, {"model": "m", **base, **fields})
    assert (r.output_field, r.max_output_tokens) == (field, cap)
    assert output_cap(endpoint, r.body) == (field, cap)


@pytest.mark.parametrize("endpoint,fields,n", [
    ("chat", {}, 1), ("chat", {"n": 10}, 10), ("completions", {"n": 2, "best_of": 5}, 5),
    ("completions", {"prompt": ["a"] * 8}, 8), ("completions", {"prompt": ["a"] * 8, "n": 3}, 24),
    ("completions", {"prompt": [[1, 2], [3]], "n": 2}, 4), ("completions", {"prompt": [1, 2]}, 1),
])
def test_sequences_count_every_generated_output(endpoint, fields, n):
    base = ({"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat"
            else {"prompt": "hi"})
    assert parse_request(endpoint, {"model": "m", **base, **fields}).sequences == n


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
])
def test_parse_request_names_the_param(body, param):
    with pytest.raises(Rejected) as e:
        parse_request("chat", body)
    assert e.value.outcome is Outcome.INVALID_REQUEST and e.value.param == param


def test_tenant_directory():
    cfg = TenantsConfig.model_validate({
        "allow_anonymous": True,
        "tenants": [{"name": "a", "api_key_hashes": [hash_key("k1"), hash_key("k2")]},
                    {"name": "b", "api_key_hashes": [hash_key("k3")]}]})
    d = TenantDirectory(cfg)
    assert d.resolve("k2", "10.0.0.1").name == "a"
    assert d.resolve("k3", "127.0.0.1").name == "b"
    assert d.resolve(None, "127.0.0.1").name == "anonymous"
    assert d.resolve(None, "::1").name == "anonymous"
    for key, remote in [(None, "10.1.2.3"), ("nope", "127.0.0.1")]:
        with pytest.raises(Rejected) as e:
            d.resolve(key, remote)
        assert e.value.outcome.status == 401


def test_shipped_config_is_valid():
    cfg = load_config()
    assert cfg.gateway.max_body_bytes == 8 * 1024 * 1024
    assert cfg.engines.model_names() == ["gemma3-270m", "all-minilm-l6-v2"]
    assert cfg.tenants.allow_anonymous


def test_an_empty_config_file_is_an_error_not_the_defaults(tmp_path):
    for kind, hint in (("tenants", "tenants: []"), ("gateway", "{}")):
        p = tmp_path / f"{kind}.yaml"
        p.write_text("# being rewritten\n")
        with pytest.raises(ConfigError) as e:
            load_file(kind, p)
        assert str(p) in str(e.value) and "empty" in str(e.value) and hint in str(e.value)
        p.write_text(hint + "\n")
        load_file(kind, p)  # written explicitly: valid


def test_config_errors_name_file_field_and_value(tmp_path):
    p = tmp_path / "tenants.yaml"
    p.write_text("tenants:\n  - name: acme\n    weight: -2\n")
    with pytest.raises(ConfigError) as e:
        load_file("tenants", p)
    assert str(p) in str(e.value) and "tenants.0.weight" in str(e.value) and "-2" in str(e.value)
    p.write_text("tenants:\n  - name: acme\n    api_key_hashes: [abc]\n")
    with pytest.raises(ConfigError) as e:
        load_file("tenants", p)
    assert "api_key_hashes" in str(e.value) and "'abc'" in str(e.value)
    p.write_text("tenants: [oops\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_file("tenants", p)
    g = tmp_path / "gateway.yaml"
    g.write_text("port: 80\nmax_body_byts: 5\n")
    with pytest.raises(ConfigError, match="max_body_byts"):
        load_file("gateway", g)


def test_defaults_merge_under_tenants(tmp_path):
    p = tmp_path / "tenants.yaml"
    p.write_text("defaults: {requests_per_min: 60, priority: batch}\n"
                 "tenants:\n  - {name: a}\n  - {name: b, priority: interactive}\n")
    cfg = load_file("tenants", p)
    assert [(t.requests_per_min, t.priority) for t in cfg.tenants] == [(60, "batch"), (60, "interactive")]
    assert cfg.anonymous.requests_per_min == 60


def test_check_config_cli(tmp_path, capsys):
    from gateway.cli import main

    bad = tmp_path / "engines.yaml"
    bad.write_text("engines:\n  - {name: e, model: m, kind: external}\n")
    assert main(["check-config", str(bad)]) == 1
    assert "kind external needs url" in capsys.readouterr().err
    assert main(["check-config", "config/gateway.yaml", "config/tenants.yaml"]) == 0


@pytest.mark.parametrize("raw,fragment", [
    (b'{"model": "m", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}", "nested too deeply"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "surrogate"),
])
def test_hostile_json_is_a_400(raw, fragment):
    with pytest.raises(Rejected) as e:
        parse_json(raw)
    assert e.value.outcome is Outcome.INVALID_REQUEST and fragment in e.value.message


def test_paired_surrogate_escapes_are_characters():
    assert parse_json(b'{"c": "\\ud83d\\ude80"}') == {"c": "\U0001F680"}


def test_non_string_content_part_text_is_ignored_by_the_estimate():
    r = parse_request("chat", {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}, {"type": "text", "text": "hi"}]}]})
    assert r.prompt_text == "hi"


def test_keys_that_are_not_utf8_or_empty_match_no_tenant():
    d = TenantDirectory(TenantsConfig.model_validate({"allow_anonymous": True}))
    for key in ("\udcff\udcfe", ""):  # aiohttp surrogate-escapes non-UTF-8 header bytes
        with pytest.raises(Rejected) as e:
            d.resolve(key, "127.0.0.1")
        assert e.value.outcome is Outcome.UNAUTHORIZED


def test_whole_file_checks_name_the_problem_not_the_file(tmp_path):
    p = tmp_path / "tenants.yaml"
    p.write_text("tenants:\n  - {name: a}\n  - {name: a}\n")
    with pytest.raises(ConfigError) as e:
        load_file("tenants", p)
    assert "duplicate tenant names: ['a']" in str(e.value) and "<top>" not in str(e.value)
    e2 = tmp_path / "prod-Engines.yml"
    e2.write_text("engines: []\n")
    with pytest.raises(ConfigError, match="at least one engine"):
        load_file("engines", e2)


def test_engines_reload_keeps_the_sections_that_need_a_restart() -> None:
    """``reloadable_engines``: the fleet, models, scheduler plugins and saturation
    come from the new file; the restart-only sections stay and are named."""
    from config.schema import EnginesConfig
    from gateway.reload import RESTART_SECTIONS, reloadable_engines

    running = EnginesConfig.model_validate({"engines": [{"name": "a", "model": "m", "kind": "sim"}]})
    new = EnginesConfig.model_validate({
        "engines": [{"name": "b", "model": "n", "kind": "sim"}],
        "models": [{"name": "n", "degradation": {"max_tokens_cap": 8}}],
        "scheduler": {"scorers": [{"type": "queue-depth"}],
                      "prefix": {"source": "events"}, "sessions": {"ttl_s": 5}},
        "supervisor": {"probe_interval_s": 9}, "disaggregation": {"policy": "threshold"},
        "saturation": {"max_waiting": 1, "adaptive": {"enabled": False}}})
    applied, pending = reloadable_engines(running, new)
    assert pending == list(RESTART_SECTIONS)
    assert [s.name for s in applied.engines] == ["b"] and applied.models == new.models
    assert applied.scheduler.scorers == new.scheduler.scorers
    assert applied.saturation.max_waiting == 1
    assert applied.scheduler.prefix == running.scheduler.prefix
    assert applied.scheduler.sessions == running.scheduler.sessions
    assert applied.supervisor == running.supervisor
    assert applied.disaggregation == running.disaggregation
    assert applied.saturation.adaptive == running.saturation.adaptive
    assert reloadable_engines(running, running) == (running, [])


def test_the_reloader_wakes_for_its_files_and_the_configmap_links_only(tmp_path) -> None:
    """A log written next to the config files does not wake the reloader; the watched
    names, the file a watched name links to and ``..`` entries (a ConfigMap's swap) do."""
    from gateway.reload import ConfigReloader

    (tmp_path / "tenants-prod.yaml").write_text("tenants: []\n")
    (tmp_path / "tenants.yaml").symlink_to("tenants-prod.yaml")
    (tmp_path / "engines.yaml").write_text("engines: []\n")
    reloader = ConfigReloader({"tenants": (tmp_path / "tenants.yaml", lambda _: None),
                               "engines": (tmp_path / "engines.yaml", lambda _: None)})
    wakes = {name: reloader.concerns(None, str(tmp_path / name))
             for name in ("tenants.yaml", "tenants-prod.yaml", "engines.yaml", "..data",
                          "..2026_12_03_1", "gateway.log", ".tenants.yaml.swp")}
    assert wakes == {"tenants.yaml": True, "tenants-prod.yaml": True, "engines.yaml": True,
                     "..data": True, "..2026_12_03_1": True, "gateway.log": False,
                     ".tenants.yaml.swp": False}
