"""The degradation ladder: each rung, and the output-length field the client used."""

from __future__ import annotations

import pytest

from config.schema import DegradationConfig
from limits.degrade import degrade
from limits.outcome import Outcome, Rejected

FULL = DegradationConfig(max_tokens_cap=256, fallback_model="small")
BODY = {"model": "big", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000}


def test_level_zero_changes_nothing() -> None:
    d = degrade(BODY, priority="batch", config=FULL, level=0, retry_after_s=3)
    assert d.body == BODY and d.actions == () and d.header is None


def test_rung_one_caps_max_tokens() -> None:
    d = degrade(BODY, priority="standard", config=FULL, level=1, retry_after_s=3)
    assert d.body["max_tokens"] == 256 and "max_completion_tokens" not in d.body
    assert d.body["model"] == "big" and d.header == "max_tokens=256"
    assert BODY["max_tokens"] == 1000  # the input is not modified


def test_cap_goes_on_max_completion_tokens_when_the_client_used_it() -> None:
    body = {"model": "big", "max_completion_tokens": 900}
    d = degrade(body, priority="batch", config=FULL, level=1, retry_after_s=3)
    assert d.body == {"model": "big", "max_completion_tokens": 256}


def test_both_fields_never_reach_the_engine() -> None:
    body = {"model": "big", "max_completion_tokens": 100, "max_tokens": 5000}
    d = degrade(body, priority="batch", config=FULL, level=1, retry_after_s=3)
    assert d.body == {"model": "big", "max_completion_tokens": 100}
    assert d.actions == ("max_completion_tokens=100",)


def test_missing_limit_gets_the_cap_and_a_smaller_one_is_kept() -> None:
    d = degrade({"model": "big"}, priority="batch", config=FULL, level=1, retry_after_s=3)
    assert d.body["max_tokens"] == 256
    small = {"model": "big", "max_tokens": 50}
    d = degrade(small, priority="batch", config=FULL, level=1, retry_after_s=3)
    assert d.body == small and d.actions == ()


def test_rung_two_routes_to_the_fallback_and_keeps_the_cap() -> None:
    d = degrade(BODY, priority="batch", config=FULL, level=2, retry_after_s=3)
    assert d.body["model"] == "small" and d.body["max_tokens"] == 256
    assert d.header == "max_tokens=256, model=small"


def test_rung_three_sheds() -> None:
    with pytest.raises(Rejected) as exc:
        degrade(BODY, priority="batch", config=FULL, level=3, retry_after_s=4)
    assert exc.value.outcome is Outcome.OVERLOADED and exc.value.reason == "shed"
    assert exc.value.retry_after_s == 4


def test_unconfigured_rungs_are_skipped() -> None:
    only_fallback = DegradationConfig(fallback_model="small")
    d = degrade(BODY, priority="batch", config=only_fallback, level=1, retry_after_s=3)
    assert d.body["model"] == "small" and d.body["max_tokens"] == 1000
    with pytest.raises(Rejected):
        degrade(BODY, priority="batch", config=DegradationConfig(), level=1, retry_after_s=3)


def test_priorities_not_sheddable_are_never_degraded() -> None:
    d = degrade(BODY, priority="interactive", config=FULL, level=5, retry_after_s=3)
    assert d.body == BODY and d.header is None
