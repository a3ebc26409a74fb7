"""``python -m loadtest batch``'s reading of the gateway's token counter."""

from __future__ import annotations

from prometheus_client import generate_latest

from gateway.metrics import GatewayMetrics
from loadtest.batch import BATCH_TENANT, batch_output_tokens


def test_the_batch_tenants_completion_tokens_are_read_whatever_the_other_labels() -> None:
    m = GatewayMetrics(["sim-model"], semantic=False)
    m.tokens.labels(tenant=BATCH_TENANT, model="sim-model", endpoint="chat",
                    kind="completion").inc(40)
    m.tokens.labels(tenant=BATCH_TENANT, model="sim-model", endpoint="completions",
                    kind="completion").inc(2)
    m.tokens.labels(tenant=BATCH_TENANT, model="sim-model", endpoint="chat",
                    kind="prompt").inc(500)
    m.tokens.labels(tenant="acme", model="sim-model", endpoint="chat",
                    kind="completion").inc(7)
    assert batch_output_tokens(generate_latest(m.registry).decode()) == 42
