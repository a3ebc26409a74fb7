"""A request that has waited past its TTFT budget (issue 44): shed as a predicted miss
once every engine's TTFT fit is trusted, whether or not each engine's TPOT model is
(the rule that it is not held back while engines have room is
``tests/unit/test_latency_model.py``'s)."""

from __future__ import annotations

from config.schema import TenantQuota
from limits.latency_model import LatencyPrior
from limits.outcome import Outcome, Rejected
from tests.unit.test_director import Clock, FakeClient, Harness, chat, config

CHAT = TenantQuota(name="chat", priority="interactive")


def trusted_ttft(h: Harness, name: str, *, tpot_trusted: bool) -> None:
    """``name``'s model: 50 ms + 1 ms per prefill token, its TTFT fit trusted; its TPOT
    model trusted or not (predictions off by 100 %: the gradient limiter admits)."""
    lat = h.director.gate.ledger(name)
    assert lat is not None
    lat.model.__init__(LatencyPrior(ttft_overhead_s=0.05, prefill_s_per_token=0.001,
                                    rel_std=1e-6), min_samples=0)
    lat.model.tpot_rel_error = 0.0 if tpot_trusted else 1.0
    assert lat.model.ttft_trusted and lat.model.confident == tpot_trusted


async def test_a_late_request_is_shed_though_one_engine_s_tpot_model_is_untrusted() -> None:
    clock = Clock()
    h = Harness(config(engines=2), FakeClient(), clock)
    trusted_ttft(h, "e0", tpot_trusted=True)
    trusted_ttft(h, "e1", tpot_trusted=False)
    assert h.director.gate.mode("e1", 0.1) == "gradient"
    # 0.99 s of the interactive 1 s target pass while the request is read
    clock.step = 0.33
    rec, e = await h.run(chat(max_tokens=5), CHAT)
    assert isinstance(e, Rejected) and e.outcome is Outcome.OVERLOADED
    assert e.reason == "predicted_miss"
    assert h.client.calls == []
    h.assert_nothing_held()

