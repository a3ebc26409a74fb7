"""The prompt as the engine will see it, cut into chained token-block hashes
(docs/architecture.md, "One request", step 3).

Two encoders satisfy :class:`engines.interfaces.PromptEncoder`:

* :class:`FallbackEncoder` — :func:`render_fallback_chat` (a fixed Gemma-style
  template) then :func:`engines.blocks.fallback_tokenize`. This is exactly what the
  simulated engine (``kind: sim``) does, so the gateway's blocks equal the
  simulator's; it is also the deterministic fallback for engines whose tokenizer is
  not available locally (``external``, or a model folder without ``tokenizer.json``).
* :class:`HFEncoder` — the served model's own chat template (Jinja, rendered as
  ``transformers``' ``apply_chat_template`` does) and its ``tokenizer.json`` through
  the ``tokenizers`` library, as vLLM renders and tokenizes a request.

:class:`PromptBlocks` picks the encoder of each served model from ``engines.yaml``,
resolves the block size (configured, else the engine's ``block_size`` metric, else
16, vLLM's GPU default) and returns the chained block hashes of
:func:`engines.blocks.chain_block_hashes`, salted with the tenant's ``cache_salt``
as vLLM salts its prefix cache.

Cost (measured on this repository's CI machine, see ``tests/unit/test_prefix_blocks.py``):
the fallback path costs ~0.3 µs per prompt token (a 500-token chat ≈ 0.15 ms, a
12k-token Mooncake prompt ≈ 4 ms); the HF tokenizer runs in a worker thread
(:meth:`PromptBlocks.blocks` is async) because it costs ~2 µs per token and its
2 s load happens on first use.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path
from typing import Any

from config.schema import (
    DEFAULT_MEDIA_PART_TOKENS,
    FALLBACK_TOKENIZER,
    EnginesConfig,
    EngineSpec,
)
from engines.blocks import chain_block_hashes, fallback_tokenize
from engines.interfaces import PromptEncoder
from engines.pool import EnginePool
from engines.prepare import (
    MODEL_DIRNAME,
    PACKAGED_GEMMA,
    PACKAGED_MINILM,
    default_cache_dir,
    is_prepared,
    resolve_model_path,
)
from engines.token_cache import DEFAULT_MAX_TOKENS, TurnTokenCache, turn_markers

log = logging.getLogger(__name__)

#: Block size used before any engine of the model has reported ``block_size``
#: (vLLM's ``CacheConfig`` default on GPU).
DEFAULT_BLOCK_SIZE = 16


def content_text(content: Any) -> str:
    """A message's text: a string as is, the ``text`` of list parts joined without a
    separator (as the simulator and vLLM's text-only rendering join them), else ""."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and isinstance(p.get("text", ""), str))
    return ""


def json_text(value: Any) -> str:
    """``value`` as compact JSON text (as a chat template's ``tojson`` writes tool
    schemas); any JSON a request body held can be written."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def render_fallback_chat(messages: Sequence[Mapping[str, Any]],
                         tools: Sequence[Any] | None = None) -> str:
    """Render ``messages`` with a fixed Gemma-style template: ``<bos>``, the tool
    definitions as a turn ``<start_of_turn>tools\\n{json}<end_of_turn>\\n`` when
    ``tools`` is not empty, then per message ``<start_of_turn>{role}\\n{text}{tool
    calls json}<end_of_turn>\\n`` (``assistant`` is written ``model``; an assistant
    turn's ``tool_calls`` follow its text as JSON), then the generation prompt
    ``<start_of_turn>model\\n``.

    The simulated engine renders chats with this function, so equal leading
    messages give equal leading text, hence equal leading token blocks, on both
    sides; its prompt (and usage) includes the tools and tool calls, as a real
    engine's template with tool support does.
    """
    parts = ["<bos>"]
    if tools:
        parts.append(f"<start_of_turn>tools\n{json_text(list(tools))}<end_of_turn>\n")
    for m in messages:
        role = "model" if m.get("role") == "assistant" else m.get("role")
        calls = m.get("tool_calls")
        text = content_text(m.get("content")) + (json_text(calls) if calls else "")
        parts.append(f"<start_of_turn>{role}\n{text}<end_of_turn>\n")
    parts.append("<start_of_turn>model\n")
    return "".join(parts)


def media_parts(messages: Sequence[Mapping[str, Any]]) -> int:
    """Content parts that are not text (images, audio, files, video: a dict part
    without a string ``text``), counted over every message."""
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for p in m["content"]
               if isinstance(p, dict) and not isinstance(p.get("text"), str))


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """``messages`` as vLLM hands them to a chat template, in what matters for tool
    and thinking turns: a null ``content`` becomes "" (vLLM parses it as no parts,
    ``_parse_chat_message_content``), an assistant turn's ``reasoning`` (or the
    deprecated ``reasoning_content``) is given under both names
    (``ChatCompletionRequest._normalize_messages_before``, then the parser), its
    ``tool_calls[].function.arguments`` are decoded from their JSON string into an
    object (malformed or non-object JSON, empty or missing: ``{}``) and an empty
    ``tool_calls`` is dropped (``_postprocess_messages``; both in
    ``vllm/renderers/chat_utils.py``, 0.32). Nothing is modified in place."""
    out: list[Mapping[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls")
        assistant = m.get("role") == "assistant"
        has_calls = assistant and isinstance(calls, list)
        reasoning = m.get("reasoning")
        if reasoning is None:
            reasoning = m.get("reasoning_content")
        thought = assistant and reasoning is not None
        if m.get("content", "") is not None and not has_calls and not thought:
            out.append(m)
            continue
        m = dict(m)
        if m.get("content", "") is None:
            m["content"] = ""
        if thought:
            m["reasoning"] = m["reasoning_content"] = reasoning
        if has_calls and calls:
            m["tool_calls"] = [_decoded_call(c) for c in calls]
        elif has_calls:
            del m["tool_calls"]
        out.append(m)
    return out


def _decoded_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call  # vLLM refuses it (400); rendered as it is
    args = function.get("arguments")
    if isinstance(args, str) and args:
        try:
            args = json.loads(args)
        except ValueError:
            args = {}
    return {**call, "function": {**function,
                                 "arguments": args if isinstance(args, dict) else {}}}


class FallbackEncoder:
    """:func:`render_fallback_chat` + :func:`~engines.blocks.fallback_tokenize`.
    Pure Python, cheap; ``offload`` is False (a thread would only add overhead)."""

    offload = False

    def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Any] | None = None) -> list[int]:
        return fallback_tokenize(render_fallback_chat(messages, tools))

    def left_out(self, messages: Sequence[Mapping[str, Any]],
                 tools: Sequence[Any] | None) -> str:
        return ""  # the fallback template renders tools and tool calls

    def encode_text(self, text: str) -> list[int]:
        return fallback_tokenize(text)


#: The chat :meth:`HFEncoder` checks turn-by-turn tokenization on: every role, runs of
#: spaces and newlines at the turn edges, non-ASCII text.
_SAMPLE_CHAT = [
    {"role": "system", "content": "  Be brief.\n"},
    {"role": "user", "content": "Hello  there,\n\nwhat's 2+2? ¿Qué tal? 日本語 "},
    {"role": "assistant", "content": " 4.\n"},
    {"role": "user", "content": "\tand 3+3?  "},
]


class HFEncoder:
    """A model folder's chat template and ``tokenizer.json``.

    Chat: the template (``chat_template.jinja``, else ``chat_template`` in
    ``tokenizer_config.json``) rendered with ``add_generation_prompt=True`` in a
    sandboxed Jinja environment with ``trim_blocks``/``lstrip_blocks`` and the
    tokenizer config's special tokens, as ``transformers``'
    ``PreTrainedTokenizerBase.apply_chat_template`` does; the text is then encoded
    without adding special tokens (the template wrote them), as vLLM's chat
    endpoint does. Completions: the prompt encoded with special tokens (BOS).

    Tools and tool calls as vLLM renders them: ``tools`` passed to the template
    (``apply_chat_template(tools=…)``), assistant ``tool_calls`` with their
    arguments decoded (:func:`template_messages`). A template that does not read
    ``tools`` (no such variable) or ``tool_calls`` (not in its source) cannot render
    them; :meth:`left_out` gives their JSON text, which the prompt count adds.

    The tokenizer loads on first use (~2 s for Gemma 3's 262k vocabulary);
    ``offload`` is True so callers run it in a worker thread. Chats are tokenized
    turn by turn through a :class:`~engines.token_cache.TurnTokenCache` (earlier
    turns of a conversation are not tokenized again) when the template has turn
    markers and the tokenizer passes :meth:`~engines.token_cache.TurnTokenCache.verify`.

    Args:
        folder: the model folder (``tokenizer.json`` required).
        turn_cache_tokens: bound of the turn cache, token ids (0: no cache).
    """

    offload = True

    def __init__(self, folder: Path, turn_cache_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.folder = folder
        self.turn_cache_tokens = turn_cache_tokens
        self._tokenizer: Any = None
        self._template: Any = None
        self._special: dict[str, str] = {}
        self._renders_tools = self._renders_calls = False
        self._lock = threading.Lock()
        self.turns: TurnTokenCache | None = None

    def _load(self) -> None:
        with self._lock:  # worker threads may race on the first request
            if self._tokenizer is None:
                self._load_locked()

    def _load_locked(self) -> None:
        import jinja2.meta
        import jinja2.sandbox
        from tokenizers import Tokenizer

        cfg_path = self.folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text("utf-8")) if cfg_path.exists() else {}
        template_path = self.folder / "chat_template.jinja"
        source = (template_path.read_text("utf-8") if template_path.exists()
                  else cfg.get("chat_template"))
        if isinstance(source, list):  # named templates: take "default"
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = cfg.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                self._special[key] = value
        if source:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

            def raise_exception(message: str) -> None:
                raise jinja2.exceptions.TemplateError(message)

            env.globals["raise_exception"] = raise_exception
            # transformers' own filter (utils/chat_template_utils.py): Jinja's escapes HTML
            env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, \
                sort_keys=False: json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                            separators=separators, sort_keys=sort_keys)
            self._template = env.from_string(source)
            self._renders_tools = "tools" in jinja2.meta.find_undeclared_variables(
                env.parse(source))
            self._renders_calls = "tool_calls" in source
        tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        # a sentence-transformers tokenizer.json pads (and truncates) every input to a
        # fixed length (all-MiniLM-L6-v2: 128); the engine counts the tokens themselves
        tokenizer.no_padding()
        tokenizer.no_truncation()
        markers = turn_markers(source or "", (t.content for t in
                                              tokenizer.get_added_tokens_decoder().values()))
        if markers is not None and self._template is not None and self.turn_cache_tokens:
            cache = TurnTokenCache(markers,
                                   lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
                                   self.turn_cache_tokens)
            sample = self._template.render(messages=_SAMPLE_CHAT, add_generation_prompt=True,
                                           **self._special)
            self.turns = cache if cache.verify(sample) else None
        self._tokenizer = tokenizer

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Any] | None = None) -> str:
        """The chat as text; :func:`render_fallback_chat` if the model has no template."""
        self._load()
        if self._template is None:
            return render_fallback_chat(messages, tools)
        return self._template.render(messages=template_messages(messages),
                                     tools=list(tools) if tools else None,
                                     add_generation_prompt=True, **self._special)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Any] | None = None) -> list[int]:
        text = self.render_chat(messages, tools)
        if self.turns is not None:
            return self.turns.encode(text)
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def left_out(self, messages: Sequence[Mapping[str, Any]],
                 tools: Sequence[Any] | None) -> str:
        """JSON text of what the template cannot render: ``tools``, and the
        assistant turns' ``tool_calls``; "" when it renders both (or has no template:
        the fallback rendering has both)."""
        self._load()
        if self._template is None:
            return ""
        parts = [] if self._renders_tools or not tools else [json_text(list(tools))]
        if not self._renders_calls:
            parts += [json_text(m["tool_calls"]) for m in messages if m.get("tool_calls")]
        return "".join(parts)

    def encode_text(self, text: str) -> list[int]:
        self._load()
        return self._tokenizer.encode(text, add_special_tokens=True).ids


def local_model_folder(spec: EngineSpec, cache_dir: Path | None = None) -> Path | None:
    """The local folder holding ``spec``'s tokenizer (:attr:`EngineSpec.tokenizer_source`),
    or None: the prepared folder for ``packaged:gemma3-270m`` (only if already prepared —
    preparing takes a minute), or the source itself if it is a directory with a
    ``tokenizer.json``; None for :data:`~config.schema.FALLBACK_TOKENIZER`."""
    source = spec.tokenizer_source
    if source == FALLBACK_TOKENIZER:
        return None
    if source == PACKAGED_GEMMA:
        folder = (cache_dir or default_cache_dir()) / MODEL_DIRNAME
        return folder if is_prepared(folder) else None
    if source == PACKAGED_MINILM:
        source = resolve_model_path(source)
    folder = Path(source).expanduser()
    return folder if (folder / "tokenizer.json").is_file() else None


def encoder_for(spec: EngineSpec, cache_dir: Path | None = None,
                turn_cache_tokens: int = DEFAULT_MAX_TOKENS) -> PromptEncoder:
    """The encoder that reproduces ``spec``'s tokens: the tokenizer its ``tokenizer``
    field names (by default the model's own for ``kind: vllm``, the simulator's
    fallback for the other kinds) when it is on local disk (its chat turns cached up
    to ``turn_cache_tokens`` ids; 0: no cache); the fallback otherwise."""
    folder = local_model_folder(spec, cache_dir)
    return FallbackEncoder() if folder is None else HFEncoder(folder, turn_cache_tokens)


@dataclass(frozen=True)
class PromptInput:
    """The part of an OpenAI body that the engine tokenizes: ``messages`` and
    ``tools`` (chat; ``tools`` only when a list, as vLLM accepts it) or ``prompt``
    (completions: a string, a one-string list, or token ids)."""

    messages: Sequence[Mapping[str, Any]] | None = None
    prompt: Any = None
    tools: Sequence[Any] | None = None

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PromptInput:
        messages = body.get("messages")
        if isinstance(messages, list):
            tools = body.get("tools")
            return cls(messages=messages, tools=tools if isinstance(tools, list) else None)
        return cls(prompt=body.get("prompt"))


def encode(encoder: PromptEncoder, prompt: PromptInput) -> list[int]:
    """Token ids of ``prompt`` under ``encoder``; [] for shapes that are not one
    prompt (several prompts in one completions request)."""
    if prompt.messages is not None:
        return encoder.encode_chat(prompt.messages, prompt.tools)
    p = prompt.prompt
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return encoder.encode_text(p)
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return list(p)
    return []


@dataclass(frozen=True)
class Measured:
    """A prompt as the engine will tokenize it.

    Attributes:
        tokens: its token count: the rendered chat (tools and tool calls included),
            plus the JSON text of what the template cannot render, plus the model's
            ``media_part_tokens`` per non-text content part; None when the prompt
            is several prompts (the caller's estimate stands).
        blocks: chained block hashes (see :meth:`PromptBlocks.measure_sync`).
        exact: ``tokens`` is the engine's own count: the model's encoder reproduces
            the engine's (the model's own tokenizer, or the simulator's) and nothing
            was added to it; otherwise an estimate (the fallback tokenizer is within
            ~7 % of Gemma 3's, :mod:`engines.blocks`).
    """

    tokens: int | None
    blocks: tuple[int, ...]
    exact: bool = False


class PromptBlocks:
    """Chained block hashes of requests, per served model.

    Args:
        cfg: the engines section: each model's encoder comes from its first
            engine spec (:func:`encoder_for`); ``scheduler.prefix.block_size``
            fixes the block size when set; ``models[].media_part_tokens`` is the
            floor counted per non-text content part.
        pool: engines whose ``block_size`` metric gives the block size otherwise.
        encoders: override per model (tests).
        cache_dir: where ``packaged:`` models are prepared.
    """

    def __init__(self, cfg: EnginesConfig, pool: EnginePool, *,
                 encoders: Mapping[str, PromptEncoder] | None = None,
                 cache_dir: Path | None = None) -> None:
        self.pool = pool
        self.block_size_override = cfg.scheduler.prefix.block_size
        self.max_blocks = cfg.scheduler.prefix.max_blocks
        self.turn_cache_tokens = cfg.scheduler.prefix.turn_cache_tokens
        self.cache_dir = cache_dir
        self._encoders: dict[str, PromptEncoder] = dict(encoders or {})
        self._overrides = frozenset(encoders or {})
        #: models whose encoder reproduces the engine's own token count
        self._exact: set[str] = set(self._overrides)
        self._specs: dict[str, EngineSpec] = {}  # model -> the spec its encoder is from
        self._media_tokens: dict[str, int] = {}
        self._fallback = FallbackEncoder()
        self.set_engines(cfg)

    def set_engines(self, cfg: EnginesConfig) -> None:
        """Serve the models of ``cfg.engines`` (a reload): a new model, or one whose
        first spec changed kind or tokenizer, gets its encoder; a model no longer
        served loses its own. Each model's ``media_part_tokens`` is read again."""
        first: dict[str, EngineSpec] = {}
        for spec in cfg.engines:
            first.setdefault(spec.model, spec)
        self._media_tokens = {m: cfg.model_settings(m).media_part_tokens for m in first}
        for model in [m for m in self._specs if m not in first]:
            del self._specs[model], self._encoders[model]
            self._exact.discard(model)
        for model, spec in first.items():
            old = self._specs.get(model)
            if model in self._overrides or old is not None and (
                    old.kind, old.tokenizer_source) == (spec.kind, spec.tokenizer_source):
                continue
            enc = self._encoders[model] = encoder_for(spec, self.cache_dir,
                                                      self.turn_cache_tokens)
            self._specs[model] = spec
            # the simulator's tokenizer, the model's own, or one the spec names
            if spec.kind == "sim" or isinstance(enc, HFEncoder) or spec.tokenizer:
                self._exact.add(model)
            else:
                self._exact.discard(model)

    def encoder(self, model: str) -> PromptEncoder:
        return self._encoders.get(model, self._fallback)

    def block_size(self, model: str) -> int:
        """Configured block size, else the first reported ``block_size`` among the
        model's engines, else :data:`DEFAULT_BLOCK_SIZE`."""
        if self.block_size_override:
            return self.block_size_override
        for e in self.pool.engines:
            if e.model == model and e.block_size:
                return e.block_size
        return DEFAULT_BLOCK_SIZE

    def measure_sync(self, model: str, prompt: PromptInput, salt: str | None, *,
                     encoder: PromptEncoder | None = None) -> Measured:
        """The prompt's token count (:class:`Measured`) and the chained hashes of its
        full blocks (at most ``max_blocks``), salted with ``salt``; runs the encoder
        (the model's, or ``encoder``) on the calling thread."""
        encoder = encoder or self.encoder(model)
        tokens = encode(encoder, prompt)
        added = 0
        if prompt.messages is not None:
            left = encoder.left_out(prompt.messages, prompt.tools)
            added = (len(encoder.encode_text(left)) if left else 0) + \
                self._media_tokens.get(model, DEFAULT_MEDIA_PART_TOKENS) * \
                media_parts(prompt.messages)
        exact = model in self._exact and not added and encoder is self.encoder(model)
        size = self.block_size(model)
        count = len(tokens) + added if tokens else None
        if self.max_blocks is not None:
            tokens = tokens[: self.max_blocks * size]
        return Measured(count, tuple(chain_block_hashes(tokens, size, salt)), exact)

    def blocks_sync(self, model: str, prompt: PromptInput, salt: str | None) -> tuple[int, ...]:
        """:meth:`measure_sync`'s block hashes."""
        return self.measure_sync(model, prompt, salt).blocks

    async def measure(self, model: str, prompt: PromptInput, salt: str | None, *,
                      large: bool = False) -> Measured:
        """:meth:`measure_sync`, in a worker thread for encoders that ask for it and
        for a ``large`` prompt (the event loop never waits on a tokenizer load or a
        long encode: the fallback encoder and the block hashes cost ~0.25 µs per
        prompt byte, 1.6 s for a 6 MB prompt). An encoder failure (bad template
        input) gives the simulator's rendering's count (every part of the prompt
        counted, not exact) and no blocks, never an error."""
        encoder = self.encoder(model)
        run: Callable[[], Measured] = lambda: self.measure_sync(model, prompt, salt)  # noqa: E731
        try:
            if not (encoder.offload or large):
                return run()
            return await asyncio.to_thread(run)
        except Exception as e:  # noqa: BLE001 - routing must not fail a request
            log.warning("prompt blocks for %s failed: %r", model, e)
        try:
            m = await asyncio.to_thread(self.measure_sync, model, prompt, None,
                                        encoder=self._fallback)
        except Exception:  # noqa: BLE001
            return Measured(None, ())
        return Measured(m.tokens, ())

    async def blocks(self, model: str, prompt: PromptInput, salt: str | None,
                     ) -> tuple[int, ...]:
        """:meth:`measure`'s block hashes."""
        return (await self.measure(model, prompt, salt)).blocks


#: vLLM's limits on ``cache_salt`` (``validate_cache_salt`` in
#: ``vllm/entrypoints/openai/protocol.py``): non-empty, ≤ 128 characters, none of these.
MAX_CACHE_SALT = 128
_SALT_FORBIDDEN = frozenset("@/\\\x00")


def cache_salt(namespace: str, client_salt: Any = None) -> str:
    """The ``cache_salt`` a tenant's requests carry: its namespace
    (``TenantQuota.namespace``: tenants sharing a namespace share prefix-cache
    entries, no one else does). A salt the client sent is combined with it, never
    used alone, so a client can partition its own cache further but cannot reach
    another tenant's. Values vLLM would refuse (too long, forbidden characters)
    become a BLAKE2b-128 hex digest of the same input."""
    salt = namespace if not client_salt else f"{namespace}.{client_salt}"
    if len(salt) <= MAX_CACHE_SALT and not (_SALT_FORBIDDEN & set(salt)):
        return salt
    return "h-" + blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
