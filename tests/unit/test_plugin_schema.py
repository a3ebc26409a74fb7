"""The schema's plugin registry (``config/plugins.py``) and the plugin classes
(``engines/plugins.py``) name the same types, and each class's ``Params`` is the model
the schema validates its ``params`` against (the schema lives in ``config`` so that
``config`` imports nothing from ``engines``)."""

from __future__ import annotations

import pytest

from config.plugins import PLUGIN_PARAMS, NoParams, plugin_params
from config.schema import FilterConfig
from engines.plugins import FILTERS, PICKERS, SCORERS, build_filter


@pytest.mark.parametrize("role,classes", [("filter", FILTERS), ("scorer", SCORERS),
                                          ("picker", PICKERS)])
def test_both_registries_name_the_same_types_with_the_same_params(role, classes) -> None:
    assert sorted(PLUGIN_PARAMS[role]) == sorted(classes)
    for name, cls in classes.items():
        assert cls.Params is PLUGIN_PARAMS[role][name], name
        assert issubclass(cls.Params, NoParams)


def test_params_are_validated_with_defaults_by_the_schema_and_built_alike() -> None:
    cfg = FilterConfig(type="load-guard", params={"abs_threshold": 2})
    assert cfg.params == {"abs_threshold": 2.0, "rel_threshold": 0.25}
    guard = build_filter(cfg)
    assert (guard.abs_threshold, guard.rel_threshold) == (2.0, 0.25)
    with pytest.raises(ValueError, match="unknown picker type 'first'; valid types: "
                                         "max-score, round-robin"):
        plugin_params("picker", "first")
