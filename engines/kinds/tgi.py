"""Hugging Face TGI's dialect (``kind: external``, ``dialect: tgi``).

Read from TGI's ``router/src/server.rs`` (huggingface/text-generation-inference at
commit ``d957e32``, TGI 2.x/3.x; routes and ``metrics::describe_*``); checked against
the simulator speaking this dialect (``--dialect tgi``), not a real TGI server:

* ``GET /metrics`` (Prometheus text, metrics-rs exporter, unlabelled):
  ``tgi_batch_current_size`` → running, ``tgi_queue_size`` → waiting.
  ``tgi_batch_current_max_tokens`` (tokens the running batch may reach) has no
  exported budget to divide by (``--max-batch-total-tokens`` is only in ``GET /info``),
  and there are no prefix-cache counters: TGI gives no KV usage, block size or prefix
  hits here, so it is admitted by the gateway's own accounting (the learned limit).
* ``GET /health`` 200 after a real forward pass; ``GET /v1/models`` lists the
  ``model_id``; ``/v1/chat/completions`` and ``/v1/completions``.
* Accepts ``stream_options.include_usage``; no ``cache_salt`` or ``priority``.
* Errors: ``{"error": "...", "error_type": "..."}`` (a string, not OpenAI's object);
  overloaded (``--max-concurrent-requests`` reached) is 429, which the gateway retries
  on another engine (``gateway.proxy.engine_error``); a generation error is 424.
"""

from __future__ import annotations

from engines.kinds import EngineKind, present
from engines.kinds.prom import prometheus_samples
from engines.pool import MetricsSnapshot

RUNNING = "tgi_batch_current_size"
WAITING = "tgi_queue_size"


def parse(text: str, at: float, previous: MetricsSnapshot | None) -> MetricsSnapshot:
    """TGI's ``/metrics`` page → snapshot (running and waiting only).

    Raises:
        ValueError: the text is not Prometheus exposition.
    """
    v = prometheus_samples(text, (RUNNING, WAITING))
    return MetricsSnapshot(
        at=at,
        num_running=int(sum(v.get(RUNNING, ()))),
        num_waiting=int(sum(v.get(WAITING, ()))),
        signals=present(running=RUNNING in v, waiting=WAITING in v),
    )


KIND = EngineKind(
    name="tgi", metrics_path="/metrics", parse=parse,
    signals=frozenset({"running", "waiting"}),
    quirks="error body is {error: str, error_type}; overload is 429; no KV usage",
)
