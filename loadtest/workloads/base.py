"""Workload primitives: :class:`RequestSpec`, :class:`Workload`, the options every
builder takes, the shared-data location, synthetic text of a given token length and
Poisson arrivals."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

#: Filler vocabulary: common English words of ≤ 6 letters, so each " word" is exactly
#: one token under ``engines.blocks.fallback_tokenize`` and, being frequent words,
#: about one token under real BPE vocabularies too.
WORDS = tuple(w for w in """the of and to in is it you that he was for on are with as his they be
at one have this from or had by word but what some we can out other were all there
when up use your how said an each she which do their time if will way about many then
them write would like so these her long make thing see him two has look more day could
go come did number sound no most people my over know water than call first who may
down side been now find any new work part take get place made live where after back
little only round man year came show every good me give our under name very through
just form great think say help low line differ turn cause much mean before move right
boy old too same tell does set three want air well also play small end put home read
hand port large spell add even land here must big high such follow act why ask men
change went light kind off need house try us again animal point mother world near
build self earth father head stand own page should answer found study still learn
plant cover food sun four thought let keep eye never last door between city tree cross
since hard start might story saw far sea draw left late run while press close night
real life few stop open seem together next white begin got walk paper group always
music those both mark often letter until river car feet care second book carry took
rain eat room friend began idea fish north once base hear horse cut sure watch color
face wood main enough plain girl usual young ready above ever red list though feel
talk bird soon body dog family direct pose leave song measure state product black short
""".split() if len(w) <= 6)  # noqa: SIM905


def data_dir() -> Path:
    """The shared workload data: ``$SLUICE_DATA_DIR`` or ``../shared/data`` next to
    the repository root."""
    env = os.environ.get("SLUICE_DATA_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "shared" / "data"


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload.

    Attributes:
        at_s: send time, s after the workload starts.
        tenant: tenant name (the replayer maps it to an API key).
        priority: ``interactive`` | ``standard`` | ``batch`` (config.schema.PRIORITIES).
        body: OpenAI request body (chat or completions), including ``model``.
        endpoint: path, ``/v1/chat/completions`` or ``/v1/completions``.
        api_key_slot: index of the API key to use among the tenant's keys.
    """

    at_s: float
    tenant: str
    priority: str
    body: dict[str, Any]
    endpoint: str = CHAT
    api_key_slot: int = 0


@dataclass
class Workload:
    """An ordered (by ``at_s``) list of requests and where it came from."""

    name: str
    requests: list[RequestSpec] = field(default_factory=list)
    description: str = ""

    @property
    def duration_s(self) -> float:
        return self.requests[-1].at_s if self.requests else 0.0


@dataclass(frozen=True)
class WorkloadOptions:
    """Options shared by the builders (each uses those that apply).

    Attributes:
        model: ``model`` field of every body.
        limit: at most this many requests (None: no bound).
        duration_s: only requests with ``at_s`` < this (None: no bound).
        time_scale: trace time multiplier (0.5 replays twice as fast).
        rate: arrival rate for Poisson workloads, requests/s.
        max_input_tokens: cap on prompt length, tokens (traces are truncated).
        max_output_tokens: cap on ``max_tokens``.
        seed: RNG seed for arrivals and synthetic text choices.
        stream: ask for SSE streams (with ``include_usage``).
    """

    model: str = "sim-model"
    limit: int | None = None
    duration_s: float | None = None
    time_scale: float = 1.0
    rate: float = 2.0
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    seed: int = 0
    stream: bool = True

    def bounded(self, specs: list[RequestSpec]) -> list[RequestSpec]:
        """``specs`` sorted by time, cut at ``duration_s`` and ``limit``."""
        specs = sorted(specs, key=lambda s: s.at_s)
        if self.duration_s is not None:
            specs = [s for s in specs if s.at_s < self.duration_s]
        return specs[: self.limit] if self.limit is not None else specs

    def output_tokens(self, n: int) -> int:
        n = max(1, n)
        return min(n, self.max_output_tokens) if self.max_output_tokens else n

    def input_tokens(self, n: int) -> int:
        return min(n, self.max_input_tokens) if self.max_input_tokens else n

    def chat_body(self, content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
        return self.body([{"role": "user", "content": content}], max_tokens, **extra)

    def body(self, messages: list[dict[str, str]], max_tokens: int,
             **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages,
                                "max_tokens": max_tokens, **extra}
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body


#: Tokens per synthetic text block: the Mooncake trace's block size (its README).
BLOCK_TOKENS = 512


@lru_cache(maxsize=8192)
def _block_words(key: str) -> tuple[str, ...]:
    rng = random.Random(key)  # str seeds hash with SHA-512: stable across processes
    return tuple(" " + w for w in rng.choices(WORDS, k=BLOCK_TOKENS))


def text_block(key: str, n_tokens: int = BLOCK_TOKENS) -> str:
    """The first ``n_tokens`` (≤ 512) of the filler block named ``key``: words of
    :data:`WORDS` with a leading space, one fallback token each, drawn by an RNG
    seeded with ``key``. Equal keys give equal text."""
    return "".join(_block_words(key)[:n_tokens])


def synthetic_text(key: str, n_tokens: int) -> str:
    """``n_tokens`` of filler unique to ``key`` (blocks ``key/0``, ``key/1`` …)."""
    full, rest = divmod(n_tokens, BLOCK_TOKENS)
    parts = [text_block(f"{key}/{i}") for i in range(full)]
    if rest:
        parts.append(text_block(f"{key}/{full}", rest))
    return "".join(parts)


def poisson_times(n: int, rate: float, rng: random.Random) -> list[float]:
    """``n`` arrival times, s, of a Poisson process of ``rate`` requests/s."""
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out
