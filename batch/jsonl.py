"""The Batch API's input file: JSONL, one request per line, as OpenAI defines it
(https://platform.openai.com/docs/guides/batch): ``{"custom_id": str, "method":
"POST", "url": ENDPOINT, "body": {…}}``. Validated line by line when uploaded; every
error names its line (1-based).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

#: The endpoints OpenAI's Batch API runs (a batch may target those the gateway serves).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
#: Longest ``custom_id``, characters (OpenAI's limit is 512 as well).
MAX_CUSTOM_ID = 512
#: Errors reported for one file at most (the first ones, in line order).
MAX_ERRORS = 20


class InvalidFile(ValueError):
    """An input file that is not a valid batch file. ``errors``: ``(line, message)``
    pairs (line 1-based; 0 for the whole file), at most :data:`MAX_ERRORS`."""

    def __init__(self, errors: list[tuple[int, str]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"line {n}: {m}" if n else m for n, m in errors))


@dataclass(frozen=True)
class Line:
    """One request of a batch file."""

    custom_id: str
    url: str
    body: dict


def _line(n: int, raw: bytes, max_line_bytes: int) -> Line | str:
    if len(raw) > max_line_bytes:
        return f"is {len(raw)} bytes, more than the limit of {max_line_bytes}"
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        return f"is not valid JSON ({e})"
    if not isinstance(obj, dict):
        return "is not a JSON object"
    custom_id, method, url, body = (obj.get(k) for k in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        return f"'custom_id' must be a non-empty string of at most {MAX_CUSTOM_ID} characters"
    if method != "POST":
        return "'method' must be \"POST\""
    if url not in ENDPOINTS:
        return f"'url' must be one of {', '.join(ENDPOINTS)}"
    if not isinstance(body, dict):
        return "'body' must be a JSON object"
    if body.get("stream"):
        return "'body.stream' is not supported in a batch"
    if not isinstance(body.get("model"), str):
        return "'body.model' must be a string"
    return Line(custom_id, url, body)


def parse(data: bytes, *, max_lines: int, max_line_bytes: int) -> list[Line]:
    """The lines of a batch input file (blank lines skipped).

    Raises:
        InvalidFile: any line invalid, a ``custom_id`` repeated, no line at all, or
            more than ``max_lines`` lines; the errors name the lines.
    """
    lines: list[Line] = []
    errors: list[tuple[int, str]] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(lines) + len(errors) >= max_lines:
            errors.append((0, f"the file has more than {max_lines} requests"))
            break
        got = _line(n, raw, max_line_bytes)
        if isinstance(got, str):
            errors.append((n, got))
        elif got.custom_id in seen:
            errors.append((n, f"'custom_id' {got.custom_id!r} repeats line {seen[got.custom_id]}"))
        else:
            seen[got.custom_id] = n
            lines.append(got)
        if len(errors) >= MAX_ERRORS:
            break
    if not lines and not errors:
        errors.append((0, "the file has no requests"))
    if errors:
        raise InvalidFile(errors)
    return lines
