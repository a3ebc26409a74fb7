"""OpenAI request bodies: validation of the fields the gateway interprets, and the
:class:`InferenceRequest` the pipeline works on.

Only the fields below are checked; every other field (tools, tool_choice,
response_format, logprobs, n, seed, …) is forwarded to the engine untouched, in the
body exactly as the client sent it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from limits.outcome import Outcome, Rejected

Endpoint = Literal["chat", "completions"]
PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


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


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionBody(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]


BODIES: dict[Endpoint, type[_Common]] = {"chat": ChatBody, "completions": CompletionBody}


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
        prompt_tokens: estimated prompt tokens.
        max_output_tokens: the effective output cap in tokens, or None.
    """

    endpoint: Endpoint
    body: dict[str, Any]
    model: str
    stream: bool
    client_usage: bool
    prompt_text: str
    prompt_tokens: int
    max_output_tokens: int | None

    @property
    def output_field(self) -> str:
        """The output-length field the client used (``max_completion_tokens`` wins,
        as in OpenAI's and vLLM's APIs); ``max_tokens`` when neither was sent."""
        return "max_completion_tokens" if "max_completion_tokens" in self.body else "max_tokens"

    def apply_body(self, body: dict[str, Any]) -> None:
        """Replace the forwarded body (degradation: output cap, fallback model)."""
        self.body = body
        self.model = body["model"]
        self.max_output_tokens = body.get("max_completion_tokens") or body.get("max_tokens")

    def set_output_cap(self, tokens: int) -> None:
        """Set the output cap on the field the client used, never on both."""
        field = self.output_field
        self.body[field] = tokens
        self.body.pop("max_tokens" if field == "max_completion_tokens" else "max_completion_tokens", None)
        self.max_output_tokens = tokens


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
    if isinstance(parsed, ChatBody):
        text = "\n".join(_text_of(m.content) for m in parsed.messages)
        tokens = estimate_tokens(text) + 4 * len(parsed.messages)
    else:
        prompt = parsed.prompt
        if isinstance(prompt, str):
            text, tokens = prompt, estimate_tokens(prompt)
        elif prompt and isinstance(prompt[0], str):
            text = "\n".join(prompt)  # type: ignore[arg-type]
            tokens = sum(estimate_tokens(p) for p in prompt)  # type: ignore[arg-type]
        elif prompt and isinstance(prompt[0], list):
            text, tokens = "", sum(len(p) for p in prompt)  # type: ignore[arg-type]
        else:
            text, tokens = "", len(prompt)
    cap = parsed.max_completion_tokens or parsed.max_tokens
    usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
    return InferenceRequest(
        endpoint=endpoint, body=dict(body), model=parsed.model, stream=parsed.stream,
        client_usage=usage, prompt_text=text, prompt_tokens=tokens, max_output_tokens=cap,
    )
