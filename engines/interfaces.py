"""Protocols of the scheduler's plugins (docs/architecture.md, "One request", step 10).

Plugins are pure: synchronous, no I/O, no waiting. Everything they need is in the
request and the :class:`~engines.pool.Engine` views (state, in-flight count, latest
metrics snapshot), plus ``now`` from the caller's clock for freshness checks.
Implementations are chosen by a kebab-case ``type`` through
:func:`engines.plugins.plugin_class`; each names its parameters' pydantic model as
``Params`` (registered for its type in :mod:`config.plugins`) and is built from the
validated YAML (:mod:`engines.plugins`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel

from config.schema import Priority
from engines.pool import Engine
from limits.interfaces import SloView


@dataclass(frozen=True)
class SchedRequest:
    """What the scheduler knows about one request (re-exported by
    :mod:`engines.scheduler`).

    Attributes:
        model: served model name the client asked for.
        tenant: tenant name.
        prompt_tokens: estimated prompt length, tokens.
        blocks: chained hashes of the prompt's fixed-size token blocks (prefix
            affinity); empty when not computed.
        block_size: tokens per block of ``blocks`` (0 when unknown).
        session_id: the conversation's key (:func:`engines.sessions.session_key` of the
            tenant and its ``x-session-id``), if any.
        priority: ``interactive``, ``standard`` or ``batch``.
        prefix_matches: engine id → leading ``blocks`` the prefix index says that
            engine holds. Filled by :meth:`Scheduler.pick
            <engines.scheduler.Scheduler.pick>` from its index before filters and
            scorers run, so plugins stay pure; absent ids mean 0.
        session_engine: id of the engine this session was last sent to (filled by
            the scheduler from its session table), if any.
        slo: the SLO gate's view (queued prefill, TTFT̂ per engine), filled by the
            scheduler (:attr:`Scheduler.slo <engines.scheduler.Scheduler.slo>`);
            None without adaptive admission's ledgers.
    """

    model: str
    tenant: str
    prompt_tokens: int
    blocks: tuple[int, ...] = ()
    block_size: int = 0
    session_id: str | None = None
    priority: Priority = "standard"
    prefix_matches: Mapping[str, int] = field(default_factory=dict)
    session_engine: str | None = None
    slo: SloView | None = None


class Filter(Protocol):
    """Keeps the engines that may take the request.

    Returns a subset of ``engines`` in their original order; may return an empty
    list (the scheduler then falls back to the unfiltered healthy list).
    """

    #: the plugin's parameters (``params:`` in engines.yaml), a pydantic model
    Params: ClassVar[type[BaseModel]]

    def filter(
        self, req: SchedRequest, engines: Sequence[Engine], now: float
    ) -> list[Engine]: ...


class Scorer(Protocol):
    """Rates each candidate engine for the request.

    Returns one score per engine, in the order given, each in [0, 1] (1 = best).
    The scheduler multiplies it by the scorer's configured ``weight``.
    """

    #: the plugin's parameters (``params:`` in engines.yaml), a pydantic model
    Params: ClassVar[type[BaseModel]]

    def score(
        self, req: SchedRequest, engines: Sequence[Engine], now: float
    ) -> list[float]: ...


class Picker(Protocol):
    """Chooses one engine from non-empty ``engines`` given their total scores
    (same order). Returns the index of the chosen engine."""

    #: the plugin's parameters (``params:`` in engines.yaml), a pydantic model
    Params: ClassVar[type[BaseModel]]

    def pick(self, engines: Sequence[Engine], totals: Sequence[float]) -> int: ...


class PromptEncoder(Protocol):
    """Turns a request's prompt into the token ids the engine will compute
    (:mod:`engines.prompt`).

    Attributes:
        offload: True when encoding is heavy and releases the GIL (a native
            tokenizer): callers run it in a worker thread.
    """

    offload: bool

    def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Any] | None = None) -> list[int]:
        """Render ``messages`` (and ``tools``) with the model's chat template
        (generation prompt added) and tokenize the text."""
        ...

    def left_out(self, messages: Sequence[Mapping[str, Any]],
                 tools: Sequence[Any] | None) -> str:
        """JSON text of the tools and assistant tool calls the chat template cannot
        render ("" when it renders them); the prompt count adds its tokens."""
        ...

    def encode_text(self, text: str) -> list[int]:
        """Tokenize a completions prompt as the engine does (special tokens added)."""
        ...
