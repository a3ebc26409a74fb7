"""``python -m loadtest sdk-compare --json PATH``: every SDK call a modern client makes,
through the gateway and straight to the engine, side by side (issue 42).

Starts ``sluice serve`` on the shipped configuration (the packaged Gemma 3 engine and
the all-MiniLM-L6-v2 embedding engine; nothing changed), then makes each call of
:data:`CALLS` with the official ``openai`` and ``anthropic`` SDKs twice: straight to
the engine that serves the model (its own URL, as the gateway launched it), then
through the gateway with the shipped local key and ``Cache-Control: no-cache`` (so
every call reaches the engine: a greedy repeat would otherwise be a cache hit, whose
usage counts its input as cached). Sampling is greedy (``temperature`` 0) so both
paths should give the same text; each answer is reduced to what a client
reads (:func:`summarise`: HTTP outcome, object type, status, usage, event types, the
text's digest), and the report says per call whether the two summaries agree.

JSON: ``{"config": {"changed": {}}, "calls": [{"call", "direct", "gateway",
"same"}]}``, with ``direct``/``gateway`` the summaries. A call that raises is
summarised by its error class and HTTP status. Where the two differ the report says
so; it does not fail (differences are findings, e.g. ``previous_response_id`` is
served by the gateway only).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai

from loadtest.launch import gateway

MODEL, EMBEDDER = "gemma3-270m", "all-minilm-l6-v2"
KEY = "sk-sluice-local"
CHAT = [{"role": "user", "content": "Name three colours."}]


def _digest(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()[:10]


def _usage(usage: Any) -> dict[str, Any] | None:
    if usage is None:
        return None
    data = usage.model_dump() if hasattr(usage, "model_dump") else dict(usage)
    keep = ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens")
    return {k: data[k] for k in keep if data.get(k) is not None}


def summarise(obj: Any) -> dict[str, Any]:
    """What a client reads of an SDK result: type/object, status, usage, text digest;
    a list of stream events becomes the ordered set of event types and the final
    event's summary."""
    if isinstance(obj, list):  # a stream's events
        return _stream(obj)
    if isinstance(obj, dict):
        return obj
    out: dict[str, Any] = {"type": getattr(obj, "object", None) or getattr(obj, "type", None)}
    for name in ("status", "stop_reason", "role"):
        if getattr(obj, name, None) is not None:
            out[name] = getattr(obj, name)
    if getattr(obj, "usage", None) is not None:
        out["usage"] = _usage(obj.usage)
    if hasattr(obj, "output_text"):
        out["text"] = _digest(obj.output_text)
    elif getattr(obj, "choices", None):
        c = obj.choices[0]
        out["text"] = _digest(getattr(c, "text", None) or getattr(c.message, "content", None))
    elif getattr(obj, "content", None) and hasattr(obj.content[0], "text"):
        out["text"] = _digest(obj.content[0].text)
    if getattr(obj, "data", None) is not None and hasattr(obj.data[0], "embedding"):
        out["vectors"] = [len(d.embedding) for d in obj.data]
    if hasattr(obj, "input_tokens") and out["type"] is None:
        out = {"input_tokens": obj.input_tokens}
    return out


def _stream(events: list[Any]) -> dict[str, Any]:
    """A stream's event types (each once, in order), its text (chat deltas, Responses
    ``output_text`` deltas, Anthropic ``text_delta``s) and its final usage."""
    types: list[str] = []
    text, usage = [], None
    for e in events:
        t = getattr(e, "type", None) or getattr(e, "object", None) or type(e).__name__
        if t not in types:
            types.append(t)
        if getattr(e, "choices", None) and e.choices[0].delta.content:
            text.append(e.choices[0].delta.content)
        elif t == "response.output_text.delta":
            text.append(e.delta)
        elif t == "content_block_delta" and getattr(e.delta, "text", None):
            text.append(e.delta.text)
        if getattr(e, "usage", None) is not None:  # chat's usage chunk, message_delta
            usage = {**(usage or {}), **_usage(e.usage)}
        elif t == "message_start":
            usage = _usage(e.message.usage)
        elif t in ("response.completed", "response.incomplete"):
            usage = _usage(e.response.usage)
    return {"events": types, "text": _digest("".join(text)), "usage": usage}


def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        return {"ok": True, **summarise(fn())}
    except (openai.APIStatusError, anthropic.APIStatusError) as e:
        return {"ok": False, "error": type(e).__name__, "status": e.status_code}
    except (openai.APIError, anthropic.APIError) as e:
        return {"ok": False, "error": type(e).__name__}


def calls(oai: openai.OpenAI, claude: anthropic.Anthropic, http: httpx.Client,
          ) -> dict[str, Callable[[], Any]]:
    """Each call by name, for one path (``oai``/``claude``/``http`` point at it)."""
    state: dict[str, str] = {}

    def first_turn() -> Any:
        r = oai.responses.create(model=MODEL, input="My name is Ada.", temperature=0,
                                 max_output_tokens=8)
        state["id"] = r.id
        return r

    def tokenize() -> dict[str, Any]:
        r = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello there"})
        return {"status": r.status_code, "count": r.json().get("count")}

    return {
        "chat.completions.create": lambda: oai.chat.completions.create(
            model=MODEL, messages=CHAT, temperature=0, max_tokens=8),
        "chat.completions.create(stream)": lambda: list(oai.chat.completions.create(
            model=MODEL, messages=CHAT, temperature=0, max_tokens=8, stream=True,
            stream_options={"include_usage": True})),
        "completions.create": lambda: oai.completions.create(
            model=MODEL, prompt="The sky is", temperature=0, max_tokens=8),
        "responses.create": first_turn,
        "responses.create(stream)": lambda: list(oai.responses.create(
            model=MODEL, input="Say hi", temperature=0, max_output_tokens=8, stream=True)),
        "responses.create(previous_response_id)": lambda: oai.responses.create(
            model=MODEL, input="What is my name?", temperature=0, max_output_tokens=8,
            previous_response_id=state.get("id", "resp_missing")),
        "responses.retrieve": lambda: oai.responses.retrieve(state.get("id", "resp_missing")),
        "messages.create": lambda: claude.messages.create(
            model=MODEL, max_tokens=8, messages=CHAT, extra_body={"temperature": 0}),
        "messages.create(stream)": lambda: list(claude.messages.create(
            model=MODEL, max_tokens=8, messages=CHAT, stream=True,
            extra_body={"temperature": 0})),
        "messages.count_tokens": lambda: claude.messages.count_tokens(
            model=MODEL, messages=CHAT),
        "embeddings.create(str)": lambda: oai.embeddings.create(model=EMBEDDER, input="hello"),
        "embeddings.create(list)": lambda: oai.embeddings.create(
            model=EMBEDDER, input=["first text", "second text"]),
        "models.list": lambda: {"ids": sorted(m.id for m in oai.models.list())},
        "POST /tokenize": tokenize,
    }


def run(gw_url: str, engine_url: str, embed_url: str) -> list[dict[str, Any]]:
    """Every call straight to the engines, then through the gateway."""
    def clients(base: str, embed_base: str, key: str,
                headers: dict[str, str]) -> dict[str, Callable[[], Any]]:
        timeout = 300.0
        oai = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=timeout,
                            default_headers=headers)
        emb = openai.OpenAI(base_url=embed_base + "/v1", api_key=key, max_retries=0,
                            timeout=timeout, default_headers=headers)
        claude = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=300,
                                     default_headers=headers)
        out = calls(oai, claude, httpx.Client(base_url=base, timeout=timeout, headers=headers))
        for name in ("embeddings.create(str)", "embeddings.create(list)"):
            out[name] = calls(emb, claude, httpx.Client(base_url=embed_base, timeout=timeout))[name]
        return out

    direct = {k: _outcome(f) for k, f in clients(engine_url, embed_url, "none", {}).items()}
    through = {k: _outcome(f) for k, f in clients(
        gw_url, gw_url, KEY, {"Cache-Control": "no-cache"}).items()}
    return [{"call": k, "direct": direct[k], "gateway": through[k],
             "same": direct[k] == through[k]} for k in direct]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest sdk-compare", description=__doc__)
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--config-dir", type=Path, default=None,
                   help="gateway config folder (default: the shipped config/)")
    args = p.parse_args(argv)
    with gateway(args.config_dir, ready_timeout_s=900) as gw:
        [engine] = gw.engine_urls(MODEL)
        [embed] = gw.engine_urls(EMBEDDER)
        rows = run(gw.url, engine, embed)
    report = {"config": {"changed": {}}, "calls": rows}
    for r in rows:
        print(f"{r['call']:42s} {'same' if r['same'] else 'DIFFERS'}\n"
              f"    direct:  {json.dumps(r['direct'])}\n    gateway: {json.dumps(r['gateway'])}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
