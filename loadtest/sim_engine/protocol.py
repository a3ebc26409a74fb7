"""OpenAI request parsing and response shapes of the simulated engine, matching
vLLM's OpenAI server (``vllm/entrypoints/openai/``): compact JSON, SSE events
``data: {json}\\n\\n`` ending with ``data: [DONE]\\n\\n``, a role-only first chunk
for chat, a usage-only last chunk (empty ``choices``) when
``stream_options.include_usage`` is set, and errors as
``{"error": {"message", "type", "param", "code"}}``
(``vllm/entrypoints/serve/engine/protocol.py`` ``ErrorResponse``).

``n`` > 1 runs ``n`` sequences on the same prompt (choices ``index`` 0 … n − 1, usage
summing their output), as vLLM does. Simplifications (documented, deliberate): one
prompt per completion request, ``best_of`` ignored, output length = ``max_tokens``
(no stop strings, finish reason ``length``), default ``max_tokens`` 16 (OpenAI's
legacy completions default; vLLM defaults to the rest of the context). A chat that
enables thinking (``chat_template_kwargs.enable_thinking``) thinks for the first half
of its output: those tokens are ``reasoning_content``, as from vLLM's reasoning
parsers.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from engines.prompt import render_fallback_chat

DEFAULT_MAX_TOKENS = 16
#: vLLM's limits on ``cache_salt`` (``validate_cache_salt`` in
#: ``vllm/entrypoints/generate/base/protocol.py``).
MAX_CACHE_SALT_LENGTH = 128
_SALT_FORBIDDEN = set("@/\\\x00")

#: Words the simulated model emits, cycled (one token each under the fallback
#: tokenizer); content is meaningless by design.
_OUTPUT_WORDS = (" the", " sim", " says", " hello", " and", " then", " more", " text")


class RequestError(Exception):
    """An OpenAI-style error response (``status`` HTTP code)."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.err_type, self.param = message, status, err_type, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type,
                          "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class ParsedRequest:
    """What the engine needs from a request body.

    Attributes:
        chat: chat completion (else text completion).
        prompt_text: prompt as the engine sees it (chat template applied), or None
            when ``prompt_token_ids`` is given.
        prompt_token_ids: a completions prompt given as token ids.
        max_tokens: output tokens to generate, or None for the default.
        n: choices (sequences) to generate.
        stream, include_usage: SSE streaming and the final usage chunk.
        cache_salt: prefix-cache isolation key (vLLM's ``cache_salt``).
        thinking: a chat with ``chat_template_kwargs.enable_thinking: true``
            (Qwen 3's switch, which vLLM hands to the template; its reasoning parser
            then sends the thinking as ``reasoning_content``).
    """

    chat: bool
    prompt_text: str | None
    prompt_token_ids: list[int] | None
    max_tokens: int | None
    n: int
    stream: bool
    include_usage: bool
    cache_salt: str | None
    thinking: bool = False


def render_chat(messages: list[dict[str, Any]], tools: Any = None) -> str:
    """Render ``messages`` and ``tools`` (when a list) with the fixed Gemma-style
    template the gateway also uses for ``kind: sim`` engines
    (:func:`engines.prompt.render_fallback_chat`), after checking every content is a
    string or a list of parts. Equal leading messages render to equal leading text,
    hence equal leading token blocks."""
    for m in messages:
        _text(m.get("content"))
    return render_fallback_chat(messages, tools if isinstance(tools, list) else None)


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = [p for p in content if isinstance(p, dict)]
        if not all(isinstance(p.get("text", ""), str) for p in parts):
            # vLLM's pydantic models answer 400 for a text part whose text is not a string
            raise RequestError("a content part's text must be a string", param="messages")
        return "".join(p.get("text", "") for p in parts)
    raise RequestError("message content must be a string or a list of parts",
                       param="messages")


def _output_cap(body: dict[str, Any], chat: bool) -> Any:
    """The output cap as vLLM 0.32 reads it: chat takes ``max_completion_tokens`` when
    it is not null, else ``max_tokens`` (``ChatCompletionRequest.to_sampling_params``,
    ``vllm/entrypoints/openai/chat_completion/protocol.py``); completions read
    ``max_tokens`` only."""
    if chat and body.get("max_completion_tokens") is not None:
        return body["max_completion_tokens"]
    return body.get("max_tokens")


def _common(body: Any, served_model: str,
            chat: bool) -> tuple[int | None, int, bool, bool, str | None]:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model:
        raise RequestError(f"The model `{model}` does not exist.", 404, "NotFoundError",
                           "model")
    max_tokens = _output_cap(body, chat)
    if max_tokens is not None and (not isinstance(max_tokens, int)
                                   or isinstance(max_tokens, bool) or max_tokens < 1):
        raise RequestError(f"max_tokens must be at least 1, got {max_tokens}.",
                           param="max_tokens")
    n = body.get("n")
    n = 1 if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise RequestError(f"n must be at least 1, got {n}.", param="n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be a boolean", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise RequestError("stream_options must be an object", param="stream_options")
    if opts and not stream:
        raise RequestError("Stream options can only be defined when `stream=True`.",
                           param="stream_options")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt
                             or len(salt) > MAX_CACHE_SALT_LENGTH
                             or _SALT_FORBIDDEN & set(salt)):
        raise RequestError("Parameter 'cache_salt' must be a non-empty string of at most "
                           "128 characters without '@', '/', '\\\\' or NUL.",
                           param="cache_salt")
    return max_tokens, n, stream, bool(opts.get("include_usage")), salt


def parse_chat(body: Any, served_model: str) -> ParsedRequest:
    """Validate a ``/v1/chat/completions`` body; raises :class:`RequestError`."""
    max_tokens, n, stream, include_usage, salt = _common(body, served_model, chat=True)
    messages = body.get("messages")
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                       for m in messages)):
        raise RequestError("messages must be a non-empty list of {role, content}",
                           param="messages")
    kwargs = body.get("chat_template_kwargs")
    thinking = isinstance(kwargs, dict) and kwargs.get("enable_thinking") is True
    return ParsedRequest(True, render_chat(messages, body.get("tools")), None, max_tokens, n,
                         stream, include_usage, salt, thinking)


def parse_completion(body: Any, served_model: str) -> ParsedRequest:
    """Validate a ``/v1/completions`` body (prompt: a string, a one-string list or
    a list of token ids); raises :class:`RequestError`."""
    max_tokens, n, stream, include_usage, salt = _common(body, served_model, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return ParsedRequest(False, prompt, None, max_tokens, n, stream, include_usage, salt)
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                    for t in prompt)):
        return ParsedRequest(False, None, list(prompt), max_tokens, n, stream, include_usage,
                             salt)
    raise RequestError("prompt must be a non-empty string or list of token ids "
                       "(one prompt per request)", param="prompt")


def check_length(num_prompt: int, max_tokens: int | None, max_model_len: int) -> int:
    """Output length to generate; raises vLLM's context-length errors
    (``vllm/renderers/params.py``)."""
    if num_prompt > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"your prompt contains {num_prompt} input tokens, which exceeds this limit "
            f"even without any output tokens. Please reduce the length of the input "
            f"prompt.", param="input_tokens")
    wanted = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if max_tokens is None:
        wanted = min(wanted, max_model_len - num_prompt)
    if wanted < 1 or num_prompt + wanted > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"you requested {num_prompt + wanted} tokens ({num_prompt} in the input, "
            f"{wanted} in the completion). Please reduce the length of the input or "
            f"the completion.", param="max_tokens")
    return wanted


def output_text(start: int, stop: int) -> str:
    """Text of output tokens ``start`` … ``stop − 1`` (deterministic)."""
    return "".join(_OUTPUT_WORDS[i % len(_OUTPUT_WORDS)] for i in range(start, stop))


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    """OpenAI usage; ``prompt_tokens_details.cached_tokens`` only when ``cached`` is
    given (vLLM fills it with ``--enable-prompt-tokens-details``, else null)."""
    details = None if cached is None else {"cached_tokens": cached}
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion, "prompt_tokens_details": details}


def dumps(obj: Any) -> bytes:
    """Compact JSON, as pydantic's ``model_dump_json`` writes it."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class ResponseShape:
    """Builds one request's chunks and final body (``id`` and ``created`` fixed).
    ``request_id``: the client's ``X-Request-Id``, which vLLM makes the response id
    (``chatcmpl-<id>`` / ``cmpl-<id>``); None draws a random one.
    ``reasoning_tokens``: a chat's first output tokens that are thinking, sent as
    ``reasoning_content`` (stream) and ``message.reasoning_content`` (JSON)."""

    def __init__(self, chat: bool, model: str, request_id: str | None = None,
                 reasoning_tokens: int = 0) -> None:
        self.chat, self.model = chat, model
        self.reasoning_tokens = reasoning_tokens if chat else 0
        self.id = new_id(chat) if request_id is None else \
            f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def role_chunk(self, index: int = 0) -> bytes:
        return sse({**self._head("chat.completion.chunk"), "choices": [
            {"index": index, "delta": {"role": "assistant", "content": ""},
             "logprobs": None, "finish_reason": None}]})

    def token_chunk(self, position: int, finished: bool, index: int = 0) -> bytes:
        """The chunk of output token ``position`` (0-based) of choice ``index``."""
        text = output_text(position, position + 1)
        reason = "length" if finished else None
        if self.chat:
            key = "reasoning_content" if position < self.reasoning_tokens else "content"
            choice = {"index": index, "delta": {key: text}, "logprobs": None,
                      "finish_reason": reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        if finished:
            choice["stop_reason"] = None
        return sse({**self._head(obj), "choices": [choice]})

    def usage_chunk(self, prompt: int, completion: int, cached: int | None = None) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self._head(obj), "choices": [],
                    "usage": usage(prompt, completion, cached)})

    def full(self, outputs: list[int], prompt: int, completion: int,
             extra: dict[str, Any] | None = None, cached: int | None = None) -> bytes:
        """The non-streaming body: one choice per sequence, ``outputs`` its output
        tokens; ``extra`` adds top-level fields (``kv_transfer_params``); ``cached``
        as :func:`usage`."""
        choices: list[dict[str, Any]] = []
        for i, produced in enumerate(outputs):
            if self.chat:
                thought = min(produced, self.reasoning_tokens)
                message = {"role": "assistant", "content": output_text(thought, produced),
                           "tool_calls": []}
                if thought:
                    message["reasoning_content"] = output_text(0, thought)
                choices.append({"index": i, "message": message,
                                "logprobs": None, "finish_reason": "length",
                                "stop_reason": None})
            else:
                choices.append({"index": i, "text": output_text(0, produced), "logprobs": None,
                                "finish_reason": "length", "stop_reason": None})
        obj = "chat.completion" if self.chat else "text_completion"
        return dumps({**self._head(obj), "choices": choices,
                      "usage": usage(prompt, completion, cached), **(extra or {})})
