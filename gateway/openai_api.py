"""Request bodies of every inference endpoint: validation of the fields the gateway
interprets, and the :class:`InferenceRequest` the pipeline works on — the request side
of the endpoint adapters (the answer side, usage and stream events, is
:mod:`gateway.endpoints`).

Endpoints (:data:`PATHS`, the engine path each is forwarded to): OpenAI ``chat``,
``completions``, ``responses``, ``embeddings``; Anthropic ``messages`` and
``count_tokens``; vLLM's ``tokenize`` and ``detokenize``. Only the fields below are
checked; every other field (tools, tool_choice, response_format, logprobs, n, seed,
…) is forwarded to the engine untouched, in the body exactly as the client sent it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engines.prompt import PromptInput
from limits.degrade import Rung
from limits.outcome import Outcome, Rejected

Endpoint = Literal["chat", "completions", "responses", "messages", "count_tokens",
                   "embeddings", "tokenize", "detokenize"]
PATHS: dict[Endpoint, str] = {
    "chat": "/v1/chat/completions", "completions": "/v1/completions",
    "responses": "/v1/responses", "messages": "/v1/messages",
    "count_tokens": "/v1/messages/count_tokens", "embeddings": "/v1/embeddings",
    "tokenize": "/tokenize", "detokenize": "/detokenize",
}
#: Endpoints whose answer is generated text (the others generate nothing: their output
#: cap is 0 and the engines' latency models learn nothing from them).
GENERATES: frozenset[Endpoint] = frozenset({"chat", "completions", "responses", "messages"})
#: Endpoints that cost no tokens of the tenant's tokens/min (only requests/min).
TOKEN_FREE: frozenset[Endpoint] = frozenset({"count_tokens", "tokenize", "detokenize"})
#: The output-length field of the generating endpoints other than chat/completions
#: (OpenAI Responses ``max_output_tokens``; Anthropic Messages ``max_tokens``).
OUTPUT_FIELDS: dict[Endpoint, str] = {"responses": "max_output_tokens",
                                      "messages": "max_tokens"}
#: The field that holds the prompt, named in errors about it.
PROMPT_PARAMS: dict[Endpoint, str] = {
    "chat": "messages", "completions": "prompt", "responses": "input",
    "messages": "messages", "count_tokens": "messages", "embeddings": "input",
    "tokenize": "prompt", "detokenize": "tokens"}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Open):
    include_usage: bool | None = None


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None


class _Common(_Open):
    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=128)
    best_of: int | None = Field(None, ge=1, le=128)


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionBody(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]


class _Base(_Open):
    model: str = Field(min_length=1)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)


class ResponsesBody(_Base):
    """OpenAI Responses ``POST /v1/responses``."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    background: bool | None = None
    store: bool | None = None


class AnthropicMessage(_Open):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensBody(_Open):
    """Anthropic ``POST /v1/messages/count_tokens``."""

    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None


class MessagesBody(CountTokensBody):
    """Anthropic ``POST /v1/messages``: ``max_tokens`` is required, as Anthropic's."""

    max_tokens: int = Field(ge=1)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)


class EmbeddingsBody(_Open):
    """OpenAI ``POST /v1/embeddings``."""

    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]


class TokenizeBody(_Open):
    """vLLM ``POST /tokenize``: a ``prompt`` or chat ``messages``."""

    model: str = Field(min_length=1)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeBody(_Open):
    """vLLM ``POST /detokenize``."""

    model: str = Field(min_length=1)
    tokens: list[int]


BODIES: dict[Endpoint, type[_Open]] = {
    "chat": ChatBody, "completions": CompletionBody, "responses": ResponsesBody,
    "messages": MessagesBody, "count_tokens": CountTokensBody, "embeddings": EmbeddingsBody,
    "tokenize": TokenizeBody, "detokenize": DetokenizeBody}


def _param(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[dict[str,any]]", "list[str]", "list[int]", "list[list[int]]"):
            continue  # union-member labels pydantic adds to the location
        else:
            out += ("." if out else "") + str(part)
    return out


def parse_json(raw: bytes) -> dict[str, Any]:
    """Raises:
        Rejected: 400 ``invalid_request`` when the body is not a JSON object.
    """
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise Rejected(Outcome.INVALID_REQUEST, f"Request body is not valid JSON: {e}") from None
    except RecursionError:
        raise Rejected(Outcome.INVALID_REQUEST, "Request body is nested too deeply.") from None
    if not isinstance(body, dict):
        raise Rejected(Outcome.INVALID_REQUEST, "Request body must be a JSON object.")
    if b"\\ud" in raw.lower():  # \uD800-\uDFFF escapes: only pairs make characters
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise Rejected(Outcome.INVALID_REQUEST, "Request body contains an unpaired "
                           "UTF-16 surrogate escape.") from None
    return body


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(t for p in content if isinstance(p, dict)
                        and isinstance(t := p.get("text"), str))
    return ""


def output_cap(endpoint: Endpoint, body: Mapping[str, Any]) -> tuple[str, int | None]:
    """The output-length field the engine reads for ``endpoint`` and its value (tokens
    per generated sequence, None when unset) — the one rule every output cap follows.

    As vLLM applies it (``vllm/entrypoints/openai``): chat uses
    ``max_completion_tokens`` when it is set (not null), else ``max_tokens``
    (``ChatCompletionRequest.build_tok_params`` / ``serving.py``); completions read
    ``max_tokens`` only and ignore ``max_completion_tokens``
    (``CompletionRequest.to_sampling_params``); Responses read ``max_output_tokens``,
    Anthropic Messages ``max_tokens`` (:data:`OUTPUT_FIELDS`); the endpoints that
    generate nothing (:data:`GENERATES`) have a cap of 0.
    """
    if endpoint not in GENERATES:
        return PROMPT_PARAMS[endpoint], 0  # nothing to lower but the input
    if endpoint in OUTPUT_FIELDS:
        return OUTPUT_FIELDS[endpoint], body.get(OUTPUT_FIELDS[endpoint])
    if endpoint == "chat" and body.get("max_completion_tokens") is not None:
        return "max_completion_tokens", body["max_completion_tokens"]
    return "max_tokens", body.get("max_tokens")


def set_output_cap(endpoint: Endpoint, body: dict[str, Any], tokens: int) -> str:
    """Cap ``body``'s output at ``tokens`` on the field the engine reads
    (:func:`output_cap`), dropping the other output field so the upstream never sees
    contradictory values. Returns the field written."""
    field, _ = output_cap(endpoint, body)
    body[field] = tokens
    if endpoint in OUTPUT_FIELDS:
        return field
    body.pop("max_tokens" if field == "max_completion_tokens" else "max_completion_tokens", None)
    return field


def prompt_count(endpoint: Endpoint, body: Mapping[str, Any]) -> int:
    """Prompts in one request: 1 for chat and for a single completions prompt; the
    list's length for a completions ``prompt`` that is a list of strings or of
    token-id lists (vLLM answers each as its own request)."""
    prompt = body.get("prompt")
    if endpoint == "completions" and isinstance(prompt, list) and prompt \
            and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def sequences(endpoint: Endpoint, body: Mapping[str, Any]) -> int:
    """Sequences the engine generates for ``body``: per prompt ``max(n, best_of)``
    (``best_of`` candidates are all generated, ``n`` returned), times
    :func:`prompt_count`."""
    per_prompt = max(body.get("n") or 1, body.get("best_of") or 1)
    return per_prompt * prompt_count(endpoint, body)


@dataclass
class InferenceRequest:
    """A validated request.

    Attributes:
        endpoint: ``chat`` or ``completions``.
        body: the JSON body forwarded upstream (the client's, plus only the
            documented gateway edits).
        model: requested model name.
        stream: the client asked for SSE.
        client_usage: the client asked for ``stream_options.include_usage``.
        prompt_text: the prompt as plain text (messages joined), for estimates.
        prompt_tokens: prompt tokens of all prompts: the characters/4 estimate at
            parse time, replaced by the tokenizer's count (:meth:`measured`; tools,
            tool calls and media parts included).
        prompt_exact: ``prompt_tokens`` comes from the engine's tokenizer.
        blocks: chained KV-block hashes of the prompt (prefix routing), or ().
        large: the body is over ``gateway.offload_bytes``: work that grows with it
            (tokenising, hashing, serialising) runs in a worker thread.
        prompt: what the engine tokenizes, as chat messages or a prompt (the
            Responses and Messages inputs as the chat messages they render as).
    """

    endpoint: Endpoint
    body: dict[str, Any]
    model: str
    stream: bool
    client_usage: bool
    prompt_text: str
    prompt_tokens: int
    prompt_exact: bool = False
    blocks: tuple[int, ...] = ()
    large: bool = False
    prompt: PromptInput | None = None

    def __post_init__(self) -> None:
        if self.prompt is None:
            self.prompt = PromptInput.from_body(self.body)

    @property
    def generates(self) -> bool:
        """The answer is generated text (:data:`GENERATES`)."""
        return self.endpoint in GENERATES

    @property
    def output_field(self) -> str:
        """The output-length field the engine reads (:func:`output_cap`)."""
        return output_cap(self.endpoint, self.body)[0]

    @property
    def max_output_tokens(self) -> int | None:
        """The output cap per sequence the engine applies, tokens, or None."""
        return output_cap(self.endpoint, self.body)[1]

    @property
    def sequences(self) -> int:
        """Sequences generated (:func:`sequences`)."""
        return sequences(self.endpoint, self.body)

    @property
    def prompt_param(self) -> str:
        return PROMPT_PARAMS[self.endpoint]

    def measured(self, tokens: int | None, blocks: tuple[int, ...], *, exact: bool) -> None:
        """Record the tokenizer's view of the prompt (:class:`engines.prompt.Measured`):
        its token count (None: several prompts, the estimate stays), whether that is
        the engine's exact count, and its block hashes."""
        if tokens is not None:
            self.prompt_tokens, self.prompt_exact = tokens, exact
        self.blocks = blocks

    def set_model(self, model: str) -> None:
        """Route to ``model`` (degradation's fallback)."""
        self.body["model"] = self.model = model

    def set_output_cap(self, tokens: int) -> str:
        """:func:`set_output_cap` on this request's body; returns the field written."""
        return set_output_cap(self.endpoint, self.body, tokens)

    def apply(self, rung: Rung) -> str | None:
        """Apply one degradation rung; returns the action (``max_tokens=256``,
        ``model=small``) or None when it changes nothing (the request's own cap is
        already as low, or it already targets the fallback model)."""
        if rung.cap_output is not None:
            asked = self.max_output_tokens
            if asked is not None and asked <= rung.cap_output:
                return None
            return f"{self.set_output_cap(rung.cap_output)}={rung.cap_output}"
        if rung.fallback_model is not None and rung.fallback_model != self.model:
            self.set_model(rung.fallback_model)
            return f"model={rung.fallback_model}"
        return None


def estimate_tokens(text: str) -> int:
    """Rough token count of English text: ~4 characters per token (OpenAI's rule of
    thumb, https://platform.openai.com/tokenizer), plus 1."""
    return len(text) // 4 + 1


def parse_request(endpoint: Endpoint, body: dict[str, Any]) -> InferenceRequest:
    """Validate ``body`` for ``endpoint``.

    Raises:
        Rejected: 400 ``invalid_request`` naming the offending ``param``.
    """
    try:
        parsed = BODIES[endpoint].model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = _param(tuple(err["loc"]))
        raise Rejected(
            Outcome.INVALID_REQUEST,
            f"Invalid value for '{param}': {err['msg']}." if param else err["msg"],
            param=param or None,
        ) from None
    messages = _as_messages(parsed)
    prompt: PromptInput | None = None
    if messages is not None:
        text = "\n".join(_text_of(m["content"]) for m in messages)
        tokens = estimate_tokens(text) + 4 * len(messages)
        prompt = PromptInput(messages=messages) if not isinstance(parsed, ChatBody) else None
    elif isinstance(parsed, DetokenizeBody):
        text, tokens = "", len(parsed.tokens)
        prompt = PromptInput(prompt=parsed.tokens)
    else:
        field = "input" if isinstance(parsed, EmbeddingsBody) else "prompt"
        text, tokens = _prompt_size(getattr(parsed, field))
        if field == "input":
            prompt = PromptInput(prompt=parsed.input)  # type: ignore[attr-defined]
    opts = getattr(parsed, "stream_options", None)
    return InferenceRequest(
        endpoint=endpoint, body=dict(body), model=parsed.model,
        stream=bool(getattr(parsed, "stream", False)),
        client_usage=bool(opts and opts.include_usage), prompt_text=text, prompt_tokens=tokens,
        prompt=prompt,
    )


def _prompt_size(prompt: Any) -> tuple[str, int]:
    """The text and estimated tokens of a completions ``prompt`` or an embeddings
    ``input``: a string, strings, token ids or lists of token ids."""
    if prompt is None:
        return "", 0
    if isinstance(prompt, str):
        return prompt, estimate_tokens(prompt)
    if prompt and isinstance(prompt[0], str):
        return "\n".join(prompt), sum(estimate_tokens(p) for p in prompt)
    if prompt and isinstance(prompt[0], list):
        return "", sum(len(p) for p in prompt)
    return "", len(prompt)


def _as_messages(parsed: _Open) -> list[dict[str, Any]] | None:
    """The chat messages a body's prompt renders as (the engine renders Responses
    and Messages inputs through the chat template, vLLM's
    ``responses/utils.construct_input_messages`` and ``anthropic/serving.py``), or
    None for a body whose prompt is not a chat."""
    if isinstance(parsed, ChatBody) or (isinstance(parsed, TokenizeBody)
                                        and parsed.messages is not None):
        return [{"role": m.role, "content": m.content}
                for m in parsed.messages]  # type: ignore[union-attr]
    if isinstance(parsed, ResponsesBody):
        out = [{"role": "system", "content": parsed.instructions}] if parsed.instructions else []
        if isinstance(parsed.input, str):
            return [*out, {"role": "user", "content": parsed.input}]
        for item in parsed.input:
            if "role" in item:
                out.append({"role": item["role"], "content": item.get("content")})
            elif "output" in item:  # a function_call_output
                out.append({"role": "tool", "content": str(item["output"])})
        return out
    if isinstance(parsed, CountTokensBody):
        out = [{"role": "system", "content": parsed.system}] if parsed.system else []
        return out + [{"role": m.role, "content": m.content} for m in parsed.messages]
    return None
