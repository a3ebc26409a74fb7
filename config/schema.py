"""Pydantic schema of the three files users edit.

* ``gateway.yaml`` → :class:`GatewayConfig` (listen address, body limit, timeouts,
  counter store, queue, cache, observability).
* ``engines.yaml`` → :class:`EnginesConfig` (engines to launch or probe, per-model
  degradation, scheduler plugins and weights, supervisor timings).
* ``tenants.yaml`` → :class:`TenantsConfig` (API key hashes and quotas per tenant).

Units are in the field names: ``_s`` seconds, ``_ms`` milliseconds, ``_bytes`` bytes;
fractions are 0–1. Every model forbids unknown keys so a typo is an error, not a
silently ignored setting.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from config.plugins import plugin_params

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")

Priority = Literal["interactive", "standard", "batch"]
EngineRole = Literal["prefill", "decode", "both"]
#: Priority bands, most urgent first; the index is the band number used by queues.
PRIORITIES: tuple[Priority, ...] = ("interactive", "standard", "batch")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------- gateway


class Timeouts(_Strict):
    """Timeouts in seconds, upstream (engines) and of client connections.

    ``total_s`` is ``None`` by default: a steadily streaming answer is never cut;
    ``idle_s`` (gap between two complete SSE events; bytes that do not complete an
    event are no progress) and ``first_token_s`` catch a stuck engine.
    A non-streaming answer arrives in one piece, so it is bounded by ``non_stream_s``.
    From clients: ``request_head_s`` bounds the request head, ``request_body_s`` the
    body, ``client_write_s`` each write of a streamed answer (a client that stops
    reading), ``keepalive_s`` an idle kept-alive connection.
    """

    connect_s: float = Field(5.0, gt=0)
    first_token_s: float = Field(120.0, gt=0)
    idle_s: float = Field(60.0, gt=0)
    total_s: float | None = Field(None, gt=0)
    non_stream_s: float = Field(600.0, gt=0)
    request_body_s: float = Field(30.0, gt=0, description="to receive the request body")
    request_head_s: float = Field(
        10.0, gt=0, description="to receive a request's head (request line and headers), "
        "from the connection's opening or the first byte of a later request; then the "
        "connection is closed")
    client_write_s: float = Field(
        60.0, gt=0, description="a streamed answer's write that the client does not take "
        "within this long ends the request as a client disconnect (its slot is freed)")
    keepalive_s: float = Field(
        75.0, gt=0, description="an idle kept-alive client connection is closed after this "
        "(nginx's keepalive_timeout default)")


class LimitsConfig(_Strict):
    """Where the rate-limit counters live.

    ``store_url``: ``memory://`` (one process) or ``redis://host:port/db`` (shared by
    every gateway replica). ``redis_failure``: ``open`` falls back to a local limiter
    while Redis is unreachable or refuses writes (read-only replica, ``OOM``,
    ``MISCONF``), ``closed`` rejects with 503. ``max_pending_releases``: concurrency
    slots released while Redis was down are kept (up to this many) and released in
    Redis when it returns; past the bound the oldest free only when their lease expires.
    """

    store_url: str = "memory://"
    redis_failure: Literal["open", "closed"] = "open"
    lease_ttl_s: float = Field(600.0, gt=0, description="concurrency lease expiry, s")
    redis_timeout_s: float = Field(0.25, gt=0)
    max_pending_releases: int = Field(
        10_000, ge=1, description="slot releases kept while Redis is down, leases")

    @field_validator("store_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("memory://", "redis://", "rediss://", "unix://")):
            raise ValueError(f"must start with memory:// or redis://, got {v!r}")
        return v


class QueueConfig(_Strict):
    """Admission queue bounds, per model."""

    max_requests: int = Field(256, ge=1)
    max_tokens: int = Field(2_000_000, ge=1, description="estimated tokens queued, tokens")
    default_max_wait_s: float = Field(30.0, gt=0)
    quantum_tokens: int = Field(
        1024, ge=1, description="fair-share (DRR) credit per turn for weight 1, tokens; "
        "smaller is fairer over short periods, larger costs fewer turns per admission")


class SemanticCacheConfig(_Strict):
    enabled: bool = True
    threshold: float = Field(
        0.99, ge=0, le=1,
        description="cosine similarity 0-1; calibrated by `python -m loadtest semcache`")
    max_entries_per_scope: int = Field(100_000, ge=1)
    max_scopes: int = Field(10_000, ge=1)
    max_total_entries: int = Field(
        200_000, ge=1, description="in-memory vectors over all scopes (~2 KB each)")


class CacheConfig(_Strict):
    """Response cache. ``store_url``: ``memory://`` (LRU capped at ``max_bytes``) or
    ``redis://…`` (shared by replicas, entries expire after the tenant's TTL)."""

    enabled: bool = True
    store_url: str = "memory://"
    max_bytes: int = Field(256 * 1024 * 1024, ge=1)
    default_ttl_s: float = Field(3600.0, gt=0)
    semantic: SemanticCacheConfig = SemanticCacheConfig()
    #: how long the Responses API conversation state is kept (``previous_response_id``),
    #: s; it lives in ``store_url`` (its own LRU of ``max_bytes`` for ``memory://``)
    #: whether or not ``enabled``
    responses_ttl_s: float = Field(86400.0, gt=0)


class ObservabilityConfig(_Strict):
    metrics: bool = True
    metrics_listen: str | None = Field(None, description="host:port for a separate /metrics")
    access_log: bool = True
    tracing: bool = True
    otlp_endpoint: str | None = None
    trace_prompts: bool = False


class SloTarget(_Strict):
    """Latency targets of one priority band: ``ttft_s`` from arrival at the gateway
    to the first token (queue wait included), ``tpot_s`` mean time per output token
    after the first."""

    ttft_s: float = Field(..., gt=0, description="time to first token, s")
    tpot_s: float = Field(..., gt=0, description="time per output token, s")


class SloConfig(_Strict):
    """Per-band SLOs the adaptive admission keeps each engine within
    (``limits.engine_latency``). Defaults: interactive 1 s / 100 ms (a chat turn
    starts within a second and streams faster than reading speed, ~5 words/s);
    standard 2 s / 100 ms (API calls and agents, less sensitive to the start);
    batch 10 s / 100 ms. TPOT is the same for every band on purpose: a request of a
    looser TPOT band admitted past the tighter knee would hold the engine above it for
    a whole generation, and the next interactive request could not be placed there."""

    interactive: SloTarget = SloTarget(ttft_s=1.0, tpot_s=0.1)
    standard: SloTarget = SloTarget(ttft_s=2.0, tpot_s=0.1)
    batch: SloTarget = SloTarget(ttft_s=10.0, tpot_s=0.1)

    def target(self, priority: Priority) -> SloTarget:
        """The targets of ``priority``'s band."""
        return getattr(self, priority)


class BatchConfig(_Strict):
    """The OpenAI Batch API (``/v1/files``, ``/v1/batches``; :mod:`batch`).

    ``store_url``: ``sqlite://`` (the embedded default: ``<dir>/jobs.sqlite3`` and the
    uploaded files under ``<dir>/files``), ``sqlite:///ABS/PATH.db``, or
    ``postgresql://user@host:port/db`` (files in the database; every replica on the
    same database shares the jobs). ``dir`` is relative to the working directory.
    Limits default to OpenAI's (200 MB, 50,000 requests per file). Work is claimed
    in leases of ``lease_ttl_s`` (renewed every third of it while a line runs): a
    process that dies leaves its lines to be claimed again after at most that long.
    """

    enabled: bool = True
    store_url: str = "sqlite://"
    dir: str = ".sluice/batch"
    max_file_bytes: int = Field(200 * 1024 * 1024, ge=1024)
    max_lines: int = Field(50_000, ge=1)
    max_line_bytes: int = Field(1024 * 1024, ge=256, description="one JSONL line, bytes")
    max_completion_window_s: float = Field(7 * 86400.0, gt=0)
    lease_ttl_s: float = Field(30.0, gt=0, description="a claimed line's lease, s")
    max_in_flight: int = Field(128, ge=1, description="lines one gateway process runs at once")
    headroom: float = Field(
        0.1, ge=0, lt=1, description="fraction of each model's engines' learned concurrency "
        "limits kept free of batch lines for online requests (at least; more while the "
        "online arrivals need it: BandDemand.urgent_free)")
    queued_lines: int = Field(
        4, ge=1, description="batch-band tickets kept waiting in a model's admission queue "
        "(more are sent only as these are admitted: the batch takes capacity as it frees)")
    max_attempts: int = Field(3, ge=1, description="tries of a line the engine fails (5xx)")
    max_queue_wait_s: float = Field(
        600.0, gt=0, description="how long one line may wait in the admission queue, s")
    poll_interval_s: float = Field(0.5, gt=0, description="looking for work when idle, s")

    @field_validator("store_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("sqlite://", "postgresql://", "postgres://")):
            raise ValueError(f"must start with sqlite:// or postgresql://, got {v!r}")
        return v


class GatewayConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    offload_bytes: int = Field(
        16 * 1024, ge=0, description="request bodies larger than this are parsed, tokenised, "
        "hashed and serialised in a worker thread, off the event loop (that work costs "
        "~0.3 µs per byte: 16 KiB ≈ 5 ms of loop time; 0: always)")
    max_event_bytes: int = Field(
        1024 * 1024, ge=1024, description="longest streamed SSE event from an engine, bytes")
    max_response_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="longest non-streamed answer from an engine, "
        "bytes; a longer one is a 502 (n × max_tokens of text with logprobs fits easily)")
    timeouts: Timeouts = Timeouts()
    limits: LimitsConfig = LimitsConfig()
    queue: QueueConfig = QueueConfig()
    cache: CacheConfig = CacheConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    admin_key_hashes: list[str] = Field(default_factory=list)
    retry_attempts: int = Field(2, ge=1, description="engines tried before the first byte")
    max_sequences: int = Field(
        256, ge=1, description="sequences one request may make the engine generate: "
        "prompts × max(n, best_of) (gateway.openai_api.sequences); more is a 400. 256 is "
        "vLLM's default max_num_seqs on GPU, one engine's whole batch")
    default_output_tokens: int = Field(
        256, ge=1, description="output tokens reserved when a request sets no output cap; "
        "for a tenant with tokens_per_min it also becomes the request's cap (lowered to "
        "what the quota can hold), so generation never exceeds what was reserved")
    drain_grace_s: float = Field(30.0, ge=0)
    slo: SloConfig = SloConfig()
    batch: BatchConfig = BatchConfig()

    @field_validator("admin_key_hashes")
    @classmethod
    def _hashes(cls, v: list[str]) -> list[str]:
        return _check_hashes(v)


# --------------------------------------------------------------------------- tenants


def _check_hashes(v: list[str]) -> list[str]:
    for h in v:
        if not SHA256_HEX.match(h):
            raise ValueError(f"{h!r} is not a lowercase hex SHA-256 digest (64 chars)")
    return v


class TenantCache(_Strict):
    enabled: bool = True
    ttl_s: float | None = Field(None, gt=0, description="None: gateway default")
    cache_sampled: bool = Field(False, description="also cache temperature>0 answers")
    semantic_threshold: float | None = Field(None, ge=0, le=1)


class TenantQuota(_Strict):
    """One tenant's identity and quota. ``None`` means unlimited."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    api_key_hashes: list[str] = Field(default_factory=list)
    priority: Priority = "standard"
    weight: float = Field(1.0, gt=0)
    requests_per_min: int | None = Field(None, ge=1)
    tokens_per_min: int | None = Field(None, ge=1)
    batch_tokens_per_min: int | None = Field(
        None, ge=1, description="a separate tokens/min for the tenant's Batch API lines "
        "(as OpenAI keeps batch limits apart); None: they count against tokens_per_min")
    max_concurrent: int | None = Field(None, ge=1)
    max_queue_wait_s: float | None = Field(None, gt=0)
    max_prompt_tokens: int | None = Field(None, ge=1)
    max_output_tokens: int | None = Field(None, ge=1)
    max_sequences: int | None = Field(
        None, ge=1, description="per request, below gateway.max_sequences; None: that one")
    allowed_models: list[str] | None = None
    cache_namespace: str | None = None
    cache: TenantCache = TenantCache()

    @field_validator("api_key_hashes")
    @classmethod
    def _hashes(cls, v: list[str]) -> list[str]:
        return _check_hashes(v)

    @property
    def namespace(self) -> str:
        """Cache and prefix-cache namespace: shared only when configured."""
        return self.cache_namespace or f"tenant:{self.name}"


class TenantsConfig(_Strict):
    """``defaults`` are merged under every tenant (and the anonymous one) by the
    loader. ``anonymous`` allows requests without a key, from loopback clients only."""

    allow_anonymous: bool = False
    defaults: dict[str, Any] = Field(default_factory=dict)
    tenants: list[TenantQuota] = Field(default_factory=list)
    anonymous: TenantQuota = TenantQuota(name="anonymous")

    @model_validator(mode="after")
    def _unique(self) -> TenantsConfig:
        names = [t.name for t in self.tenants]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate tenant names: {sorted(dup)}")
        hashes = [h for t in self.tenants for h in t.api_key_hashes]
        if len(hashes) != len(set(hashes)):
            raise ValueError("an API key hash is listed under more than one tenant")
        return self


# --------------------------------------------------------------------------- engines


#: ``EngineSpec.tokenizer`` value naming the dependency-free tokenizer the simulator
#: uses (``engines.blocks.FallbackEncoder``).
FALLBACK_TOKENIZER = "fallback"
#: ``model_path`` / ``tokenizer`` value naming the packaged generation model, Gemma 3
#: 270M (``engines.prepare`` builds it).
PACKAGED_GEMMA = "packaged:gemma3-270m"
#: ``model_path`` value naming the packaged embedding model, all-MiniLM-L6-v2 (the
#: semantic cache's; vLLM's pooling runner serves it as installed).
PACKAGED_MINILM = "packaged:all-minilm-l6-v2"
#: every ``packaged:`` model there is
PACKAGED_MODELS = (PACKAGED_GEMMA, PACKAGED_MINILM)


class KVEventsEndpointSpec(_Strict):
    """Where an engine publishes KV-cache events (vLLM's ``--kv-events-config``):
    ``endpoint`` its PUB socket and ``replay_endpoint`` its replay (ROUTER) socket, as
    the gateway connects to them (``tcp://host:port``); ``topic`` as configured there."""

    endpoint: str = Field(..., pattern=r"^(tcp|ipc)://")
    replay_endpoint: str | None = Field(None, pattern=r"^(tcp|ipc)://")
    topic: str = ""


class EngineSpec(_Strict):
    """One engine entry; ``replicas`` > 1 expands to that many processes.

    ``kind``: ``vllm`` (the gateway launches ``vllm serve``), ``llamacpp`` (the gateway
    launches llama.cpp's ``llama-server`` on a GGUF ``model_path``; built by ``make
    llama-server``), ``sim`` (the gateway launches ``python -m loadtest.sim_engine``),
    ``external`` (only probed and routed to at ``url``). ``port`` or ``port_range``
    [first, last] for launched kinds; with neither, free ports are chosen.
    ``tokenizer``: see :attr:`tokenizer_source`.

    ``dialect``: how the engine reports load and health (:mod:`engines.kinds`):
    ``vllm``, ``llamacpp``, ``sglang``, ``tgi``, ``trtllm`` or ``openai`` (no load
    metrics: admitted by the gateway's own accounting). None: the kind's own (``vllm`` for
    ``vllm``, ``sim`` and ``external``; ``llamacpp`` for ``llamacpp``). A ``sim``
    engine speaks its dialect (``--dialect``).

    ``role`` (prefill–decode disaggregation): ``prefill`` engines take the prefill leg
    of split requests and nothing else, ``decode`` engines the decode leg and whole
    requests the gateway chooses not to split, ``both`` (the default) the same as
    ``decode`` — for the simulator and vLLM it means a connector that both sends and
    receives (``kv_both``). ``kv_connector``
    names the KV connector the engine moves blocks with (vLLM's
    ``--kv-transfer-config`` ``kv_connector``, e.g. ``NixlConnector``); a role other
    than ``both`` needs one.
    """

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    model: str = Field(..., description="served model name clients ask for")
    kind: Literal["vllm", "llamacpp", "sim", "external"] = "vllm"
    dialect: Literal["vllm", "llamacpp", "sglang", "tgi", "trtllm", "openai"] | None = None
    model_path: str | None = Field(None, description="path, 'packaged:gemma3-270m' or "
                                   "'packaged:all-minilm-l6-v2'")
    url: str | None = None
    host: str = "127.0.0.1"
    port: int | None = Field(None, ge=1, le=65535)
    port_range: tuple[int, int] | None = None
    replicas: int = Field(1, ge=1)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    cache_salt: bool | None = Field(
        None, description="accepts vLLM's cache_salt; None: yes for launched vLLM-dialect "
        "engines (vllm, sim)")
    kv_events: KVEventsEndpointSpec | None = Field(
        None, description="an external engine's KV-event publisher (launched engines get "
        "one when scheduler.prefix.source is events)")
    tokenizer: str | None = Field(
        None, description=f"how the gateway tokenizes prompts for prefix routing: "
        f"{FALLBACK_TOKENIZER!r} (the simulator's tokenizer), a folder with tokenizer.json, "
        f"or 'packaged:gemma3-270m'; None: model_path for kind vllm, {FALLBACK_TOKENIZER!r} "
        f"otherwise")
    role: EngineRole = "both"
    kv_connector: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    scheduling_policy: Literal["fcfs", "priority"] | None = Field(
        None, description="vLLM's --scheduling-policy; None: read from args (fcfs if absent)")
    cost_per_hour: float | None = Field(None, ge=0, description="price of one replica per hour")

    @property
    def priority_scheduling(self) -> bool:
        """Whether the engine runs vLLM's priority scheduler, so the gateway may send
        the band as ``priority`` (vLLM rejects a non-zero priority otherwise):
        ``scheduling_policy``, or ``--scheduling-policy priority`` in ``args``."""
        if self.scheduling_policy is not None:
            return self.scheduling_policy == "priority"
        args = list(self.args)
        for i, a in enumerate(args):
            if a == "--scheduling-policy" and i + 1 < len(args):
                return args[i + 1] == "priority"
            if a.startswith("--scheduling-policy="):
                return a.split("=", 1)[1] == "priority"
        return False

    @property
    def engine_dialect(self) -> str:
        """The dialect in effect: ``dialect``, else the kind's own."""
        return self.dialect or ("llamacpp" if self.kind == "llamacpp" else "vllm")

    @property
    def pooling(self) -> bool:
        """The engine runs vLLM's pooling runner (``--runner pooling`` in ``args``): it
        serves embeddings, generates nothing and keeps no prefix cache to publish."""
        args = self.args
        return "--runner=pooling" in args or any(
            a == "--runner" and args[i + 1:i + 2] == ["pooling"] for i, a in enumerate(args))

    @property
    def tokenizer_source(self) -> str:
        """``tokenizer``, or its default for the kind: a vLLM engine tokenizes with its
        model's own tokenizer; the simulator with :data:`FALLBACK_TOKENIZER`; an
        ``external`` server's tokenizer is not assumed to be on local disk."""
        if self.tokenizer is not None:
            return self.tokenizer
        if self.kind == "vllm" and self.model_path:
            return self.model_path
        return FALLBACK_TOKENIZER

    @field_validator("model_path", "tokenizer")
    @classmethod
    def _packaged(cls, v: str | None) -> str | None:
        if v is not None and v.startswith("packaged:") and v not in PACKAGED_MODELS:
            raise ValueError(f"no packaged model {v!r}; the packaged models are "
                             + ", ".join(repr(m) for m in PACKAGED_MODELS))
        return v

    @model_validator(mode="after")
    def _kind(self) -> EngineSpec:
        if self.kind == "external" and not self.url:
            raise ValueError("kind external needs url")
        if self.kind in ("vllm", "llamacpp") and not self.model_path:
            raise ValueError(f"kind {self.kind} needs model_path")
        if self.kind == "llamacpp" and self.dialect not in (None, "llamacpp"):
            raise ValueError("kind llamacpp speaks the llamacpp dialect")
        if self.port is not None and self.replicas > 1:
            raise ValueError("port fixes one process; use port_range with replicas > 1")
        if self.kv_events is not None and self.kind != "external":
            raise ValueError("kv_events is for external engines; launched engines get "
                             "their endpoints from the gateway")
        if self.role != "both" and self.kv_connector is None:
            raise ValueError(f"role {self.role} needs kv_connector (how the KV cache moves)")
        return self


class DegradationConfig(_Strict):
    """Degradation ladder applied to sheddable priorities while saturated:
    cap output tokens, then route to ``fallback_model``, then shed."""

    max_tokens_cap: int | None = Field(None, ge=1)
    fallback_model: str | None = None
    sheddable: list[Priority] = Field(default_factory=lambda: ["standard", "batch"])


#: Tokens counted for each non-text content part (image, audio, file) when the
#: model sets no ``media_part_tokens``: Gemma 3 encodes every image as 256 soft tokens
#: (``mm_tokens_per_image: 256`` in its ``config.json``; Gemma 3 Technical Report,
#: 2025, §2.1), OpenAI bills a low-detail image 85 tokens
#: (platform.openai.com/docs/guides/images-vision). A floor: high-detail images,
#: audio and files grow with their size, which the gateway does not decode.
DEFAULT_MEDIA_PART_TOKENS = 256


class ModelConfig(_Strict):
    name: str
    degradation: DegradationConfig = DegradationConfig()
    media_part_tokens: int = Field(
        DEFAULT_MEDIA_PART_TOKENS, ge=0, le=1_000_000,
        description="prompt tokens counted for each non-text content part (image, "
        "audio, file) of a chat: a floor, the gateway does not decode media")


class PluginConfig(_Strict):
    """A scheduler plugin of one role, chosen by its kebab-case ``type`` among the
    plugins registered for the role (:mod:`config.plugins`; implemented in
    :mod:`engines.plugins`); ``params`` are checked against the type's ``Params``
    model, and stored with its defaults filled in.
    An unknown type is an error at ``….type`` listing the valid ones; a bad
    parameter, one at ``….params.<name>``. Use :class:`FilterConfig`,
    :class:`ScorerConfig` or :class:`PickerConfig`."""

    role: ClassVar[str]
    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type")
    @classmethod
    def _known_type(cls, v: str) -> str:
        plugin_params(cls.role, v)
        return v

    @field_validator("params")
    @classmethod
    def _typed_params(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "type" not in info.data:  # the type is already reported as unknown
            return v
        params: BaseModel = plugin_params(cls.role, info.data["type"]).model_validate(v)
        return params.model_dump()


class FilterConfig(PluginConfig):
    """A filter: removes engines that should not take the request."""

    role: ClassVar[str] = "filter"


class ScorerConfig(PluginConfig):
    """A scorer; ``weight`` multiplies its 0–1 score in the total."""

    role: ClassVar[str] = "scorer"
    weight: float = Field(1.0, ge=0)


class PickerConfig(PluginConfig):
    """The picker: chooses the engine from the total scores."""

    role: ClassVar[str] = "picker"


class PrefixConfig(_Strict):
    """Prompt blocks and the prefix index (``engines.prefix.PrefixIndex``).

    ``block_size``: tokens per hashed block; None takes the engine's reported
    ``block_size``. ``max_blocks``: hash at most this many leading blocks (bounds
    per-request work on huge prompts); None hashes all. ``cache_salt``: send each
    tenant's namespace as vLLM's ``cache_salt`` so tenants never share prefix-cache
    entries (engines whose spec does not accept it get none). ``source``: where the
    index learns what engines hold — ``events`` (``engines.prefix_events``: each
    engine's KV-cache events; launched engines get ``--kv-events-config``, external
    ones need ``kv_events``) or ``approximate`` (``engines.prefix.PrefixIndex``).
    """

    block_size: int | None = Field(None, ge=1, description="tokens per block")
    max_blocks: int | None = Field(None, ge=1)
    max_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="index memory cap, bytes")
    ttl_s: float = Field(600.0, gt=0, description="index entry lifetime, s")
    cache_salt: bool = True
    source: Literal["events", "approximate"] = Field(
        "approximate", description="events: the engines' KV-cache events (precise); "
        "approximate: the gateway's routing history")
    turn_cache_tokens: int = Field(
        4_000_000, ge=0, description="token ids of chat turns kept so a conversation's "
        "earlier turns are not tokenized again (engines.token_cache); 0: off")
    predicted_ttl_s: float = Field(
        10.0, gt=0, description="with events: a routed request's blocks count as held on "
        "its engine this long before the engine reports them, s")


class SessionsConfig(_Strict):
    """Sticky ``x-session-id`` routing table (``engines.sessions.SessionTable``)."""

    max_sessions: int = Field(100_000, ge=1)
    ttl_s: float = Field(1800.0, gt=0)


class SchedulerConfig(_Strict):
    filters: list[FilterConfig] = Field(default_factory=list)
    scorers: list[ScorerConfig] = Field(
        default_factory=lambda: [ScorerConfig(type="least-in-flight")]
    )
    picker: PickerConfig = Field(default_factory=lambda: PickerConfig(type="max-score"))
    prefix: PrefixConfig = PrefixConfig()
    sessions: SessionsConfig = SessionsConfig()


class SupervisorConfig(_Strict):
    startup_grace_s: float = Field(600.0, gt=0)
    probe_interval_s: float = Field(2.0, gt=0)
    probe_timeout_s: float = Field(5.0, gt=0)
    failure_threshold: int = Field(3, ge=1)
    inference_probe_idle_s: float = Field(30.0, gt=0)
    metrics_interval_s: float = Field(1.0, gt=0)
    metrics_stale_s: float = Field(5.0, gt=0)
    restart_backoff_s: float = Field(1.0, gt=0)
    restart_backoff_max_s: float = Field(60.0, gt=0)
    max_restarts: int = Field(10, ge=0)
    stop_grace_s: float = Field(10.0, ge=0)


class AdaptiveConfig(_Strict):
    """The learned per-engine admission (``limits.engine_latency``): each engine's
    TTFT and TPOT are fitted online and an engine takes a request only while the
    predictions meet the request's band SLO (``gateway.yaml`` ``slo``).

    ``confidence_z``: standard deviations added to each prediction (2: a request is
    placed when it is predicted to meet its SLO with ~98 % confidence — the SLO is
    per request, and the spread of per-request TPOT around the mean at a given batch
    is what the knee must absorb; 1 measured ~84 % TPOT attainment at 3× on the
    simulator). ``forgetting``: the fit's
    forgetting factor per request (0.97: the last ~33 requests weigh most).
    ``min_samples``: finished requests per engine before the model replaces the
    gradient limiter. ``max_rel_error``: the model also yields to it while its
    recent TPOT predictions are off by more than this fraction (drift)."""

    enabled: bool = True
    confidence_z: float = Field(2.0, ge=0)
    forgetting: float = Field(0.97, gt=0, le=1)
    min_samples: int = Field(20, ge=1)
    max_rel_error: float = Field(0.35, gt=0)


class SaturationConfig(_Strict):
    """When an engine is saturated for admission (``limits.saturation``): KV-cache
    usage at or above ``kv_watermark`` (``batch_kv_watermark`` for batch, keeping
    headroom for online traffic), more than ``max_waiting`` requests waiting inside
    the engine, ``max_in_flight`` requests of this gateway already running on it, or
    metrics older than ``supervisor.metrics_stale_s``. An engine that reports no
    KV-cache usage is admitted by the gateway's own accounting: with ``adaptive``
    enabled by the concurrency limit it learns from its latency observations,
    starting at ``unmetered_max_in_flight``; with it disabled, by that fixed number.
    Either way never more than the engine's slots where it reports them (llama.cpp)."""

    kv_watermark: float = Field(0.9, gt=0, le=1, description="KV usage fraction 0-1")
    batch_kv_watermark: float = Field(0.8, gt=0, le=1, description="KV usage fraction 0-1")
    max_waiting: int = Field(4, ge=0, description="requests waiting in the engine")
    max_in_flight: int | None = Field(
        None, ge=1, description="requests this gateway keeps in flight on one engine "
        "(None: no cap); the batch size that still meets the TPOT SLO")
    interactive_reserve: int = Field(
        0, ge=0, description="slots of max_in_flight only interactive requests may take")
    unmetered_max_in_flight: int = Field(
        4, ge=1, description="requests in flight on an engine that reports no KV-cache "
        "usage (llama.cpp, TGI, a server without /metrics): the learned limit's starting "
        "point with adaptive admission, the fixed cap without it")
    adaptive: AdaptiveConfig = AdaptiveConfig()

    @model_validator(mode="after")
    def _order(self) -> SaturationConfig:
        if self.batch_kv_watermark > self.kv_watermark:
            raise ValueError("batch_kv_watermark must not exceed kv_watermark")
        if self.interactive_reserve and (self.max_in_flight is None
                                         or self.interactive_reserve >= self.max_in_flight):
            raise ValueError("interactive_reserve needs a larger max_in_flight")
        return self


class DisaggregationConfig(_Strict):
    """Prefill–decode disaggregation: whether and where the gateway splits a request
    into a prefill leg and a decode leg (only for models with ``role: prefill``
    engines; ``gateway.disagg``).

    ``policy``: ``predicted`` chooses per request the sooner by predicted TTFT of
    splitting it (prefill wait + uncached prefill + KV transfer + decode-engine wait)
    and running it on a decode engine, where a busy decode engine takes only prompts
    that fit one step's prefill budget and holds them at the gateway until they fit
    beside its outstanding prefill; ``threshold`` splits every prompt of at least
    ``threshold_tokens`` tokens and sends the others to a decode engine at once (the
    fixed threshold, the baseline).
    ``max_decode_stall_ms``: how far the prefill one step of a busy decode engine
    carries may stretch its streams' inter-token gaps; None (default): up to the
    tightest TPOT target (Sarathi-Serve's token budget from the engine's fitted step
    time, :meth:`gateway.disagg.Disaggregator.step_tokens`).
    ``kv_bytes_per_token`` (2 × layers × KV heads × head dim × dtype bytes) and
    ``transfer_gbps`` give the predicted transfer time (None: not counted).
    ``prefill_tokens_per_s`` is each engine's prefill speed until the gateway has
    observed it. ``prefill_hold_tokens``: prompt tokens outstanding on a prefill engine
    (sent, not yet past their first token) from which further legs wait at the gateway
    and leave shortest first within the deadlines (``gateway.prefill_queue``); the
    engines' ``--max-num-batched-tokens`` (vLLM's default for large GPUs, 8192) keeps
    every engine step full.
    """

    policy: Literal["predicted", "threshold"] = "predicted"
    threshold_tokens: int = Field(512, ge=1, description="split prompts this long, tokens")
    max_decode_stall_ms: float | None = Field(
        None, ge=0, description="time the prefill in one step of a busy decode engine may "
                                "add to it, ms (None: up to the TPOT target)")
    kv_bytes_per_token: int | None = Field(None, ge=1, description="bytes of KV per token")
    transfer_gbps: float = Field(100.0, gt=0, description="KV transfer bandwidth, Gbit/s")
    prefill_tokens_per_s: float = Field(
        10_000.0, gt=0, description="prior prefill speed per engine, tokens/s")
    prefill_hold_tokens: int = Field(
        8192, ge=1, description="prompt tokens outstanding on a prefill engine from which "
                                "the gateway holds further prefill legs")


class EnginesConfig(_Strict):
    engines: list[EngineSpec] = Field(default_factory=list)
    models: list[ModelConfig] = Field(default_factory=list)
    # built per instance: the scheduler's default plugins are validated against the
    # plugin registry in engines/, which must not be imported while this module loads
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    supervisor: SupervisorConfig = SupervisorConfig()
    saturation: SaturationConfig = SaturationConfig()
    disaggregation: DisaggregationConfig = DisaggregationConfig()

    @model_validator(mode="after")
    def _unique(self) -> EnginesConfig:
        names = [e.name for e in self.engines]
        if len(names) != len(set(names)):
            raise ValueError("engine names must be unique")
        return self

    def model_names(self) -> list[str]:
        """Served model names, in configuration order, without duplicates."""
        return list(dict.fromkeys(e.model for e in self.engines))

    def model_settings(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        return ModelConfig(name=name)


class Config(_Strict):
    """The whole configuration; ``paths`` records which files it came from."""

    gateway: GatewayConfig = GatewayConfig()
    engines: EnginesConfig = Field(default_factory=EnginesConfig)  # see scheduler above
    tenants: TenantsConfig = TenantsConfig()
    paths: dict[str, str] = Field(default_factory=dict)
