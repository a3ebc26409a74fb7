"""Loading the three config files: the shipped ones are valid, errors name the
file, the field and the value, ``sluice check-config``."""

from __future__ import annotations

import pytest

from config.loader import ConfigError, load_config, load_file


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
