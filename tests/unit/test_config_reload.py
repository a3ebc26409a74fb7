"""Reloading config files (``gateway/reload.py``): what an engines.yaml reload
applies, and which file events wake the reloader."""

from __future__ import annotations


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
