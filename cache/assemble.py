"""Rebuild the non-streaming response body from a streamed answer, so a streamed
answer can be cached and later replayed as JSON or SSE (:mod:`cache.replay`).

The gateway feeds every parsed ``data:`` JSON chunk it relayed to the client (not
``[DONE]``) into :meth:`StreamAssembler.feed`. :meth:`StreamAssembler.result` gives
the body the engine would have returned without ``stream`` — or None when the stream
is not a complete, cacheable answer: no ``[DONE]`` seen (:meth:`done` not called),
an ``error`` chunk, a choice without ``finish_reason``, or streamed tool-call deltas
(not reassembled; such answers are not cached).
"""

from __future__ import annotations

from typing import Any

from cache.keys import EndpointKind

_OBJECT = {"chat": "chat.completion", "completions": "text_completion"}


class StreamAssembler:
    """Accumulates the chunks of one streamed response (see module docstring).

    Args:
        endpoint: ``chat`` or ``completions``.
    """

    def __init__(self, endpoint: EndpointKind) -> None:
        self.endpoint = endpoint
        self._head: dict[str, Any] = {}
        self._choices: dict[int, dict[str, Any]] = {}
        self._usage: dict[str, Any] | None = None
        self._broken = False
        self._done = False

    def feed(self, chunk: dict[str, Any]) -> None:
        """Add one parsed SSE chunk."""
        if "error" in chunk:
            self._broken = True
            return
        for name in ("id", "created", "model", "system_fingerprint"):
            if name in chunk:
                self._head.setdefault(name, chunk[name])
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for part in chunk.get("choices") or []:
            self._merge(part)

    def _merge(self, part: dict[str, Any]) -> None:
        choice = self._choices.setdefault(part.get("index", 0), {"text": [], "logprobs": []})
        if self.endpoint == "chat":
            delta = part.get("delta") or {}
            if delta.get("tool_calls"):
                self._broken = True
            choice["role"] = choice.get("role") or delta.get("role")
            choice["text"].append(delta.get("content") or "")
        else:
            choice["text"].append(part.get("text") or "")
        logprobs = part.get("logprobs")
        if logprobs:
            choice["logprobs"].append(logprobs)
        if part.get("finish_reason"):
            choice["finish_reason"] = part["finish_reason"]

    def done(self) -> None:
        """Record that ``data: [DONE]`` arrived."""
        self._done = True

    def result(self) -> dict[str, Any] | None:
        """The assembled body, or None if the stream was not a complete answer."""
        if self._broken or not self._done or not self._choices:
            return None
        if any("finish_reason" not in c for c in self._choices.values()):
            return None
        body: dict[str, Any] = {**self._head, "object": _OBJECT[self.endpoint],
                                "choices": [self._choice(i, c)
                                            for i, c in sorted(self._choices.items())]}
        if self._usage is not None:
            body["usage"] = self._usage
        return body

    def _choice(self, index: int, c: dict[str, Any]) -> dict[str, Any]:
        text = "".join(c["text"])
        logprobs = _merge_logprobs(c["logprobs"])
        if self.endpoint == "chat":
            return {"index": index, "message": {"role": c.get("role") or "assistant",
                                                "content": text},
                    "logprobs": logprobs, "finish_reason": c["finish_reason"]}
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": c["finish_reason"]}


def _merge_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Concatenate the per-chunk logprob lists (chat: ``content``; completions:
    ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)."""
    if not parts:
        return None
    merged: dict[str, Any] = {}
    for part in parts:
        for name, value in part.items():
            if isinstance(value, list):
                merged.setdefault(name, []).extend(value)
            else:
                merged.setdefault(name, value)
    return merged
