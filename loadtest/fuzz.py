"""``python -m loadtest fuzz --requests N --json PATH``: hostile and odd OpenAI
requests against ``sluice serve`` in front of simulated engines.

Requests come from the hypothesis strategy :func:`requests` (the test suite runs the
same one, ``tests/integration/test_fuzz.py``): JSON bodies built around every OpenAI
field (``n``, ``best_of``, ``logit_bias``, ``tools``, ``response_format``, image
parts, token-id prompts, prompt lists, …) each either valid or wrong (wrong types,
huge and tiny numbers, odd Unicode, deep nesting), raw bodies (duplicate keys,
truncated or non-UTF-8 JSON, 10⁵-deep nesting, huge number literals) and odd
headers (bad keys, ``x-request-timeout``, ``Cache-Control``), sent ``--concurrency``
at a time (default 32). Bounded-work shapes (:func:`sequence_body`, :func:`huge_body`):
sequence multipliers (completions prompt lists × ``n`` × ``best_of`` around
``gateway.max_sequences``) and, one request in :data:`HUGE_ONE_IN`, a prompt of 1 to
8.5 MB (over the 8 MiB body limit: 413). The simulated engines compress their
answers whenever asked (``--compress``): the gateway must ask for ``identity``.

Invariants, per request (:func:`check`): no 5xx other than load shedding
(``server_errors``); every error an OpenAI error object; a stream ends with
``[DONE]`` or an error event. After the run, once idle: nothing left held
(``leaked_slots``: the sum of :func:`loadtest.harness.leftovers` after the last
batch; every ``--batch`` requests the run waits for idle and checks, naming the
batch that leaked on stderr); and for every
request the gateway reserved tokens for, the tokens it settled did not exceed the
reservation (``overshoot_tokens``: Σ max(0, input + output − reserved), from the
gateway's spans, :class:`loadtest.harness.TraceSink`).

Output keys: ``requests``, ``status_counts``, ``server_errors``, ``leaked_slots``,
``overshoot_tokens``. Failing examples go to stderr (``--examples`` of them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from loadtest.harness import (
    MODEL,
    TraceSink,
    api_key,
    error_problem,
    is_server_error,
    new_trace,
    settled,
    sim_engines,
    stream_end,
    tenant_entry,
    trace_env,
    write_config,
)
from loadtest.launch import gateway
from loadtest.report import write_json

#: Tenants of the fuzz stand: no limits; an output cap (``max_output_tokens``, the
#: output-cap field rules); tokens/min, requests/min and a concurrency lease.
TENANTS = [tenant_entry("open"),
           tenant_entry("capped", max_output_tokens=24, max_prompt_tokens=3000),
           tenant_entry("metered", tokens_per_min=10**7, requests_per_min=10**6,
                        max_concurrent=64, priority="batch")]

# ----------------------------------------------------------------------------- values

_ODD_TEXT = ["", " ", "\x00", "\u202e\u0644\u0627", "\U0001F680" * 3, "e\u0301" * 4,
             "\ufeff", "\ud7ff\ue000", "日本語のテキスト", "\u200b\u200d", "a" * 5000,
             "\\u0000", "</s><|im_end|>", "{{ bos_token }}", "\n\n\n"]
#: text: ASCII, any code point but lone surrogates, hand-picked oddities and (one
#: time in 16) lone surrogates, sent as \\udXXX escapes
_ascii, _utf8 = st.text(max_size=40), st.text(st.characters(codec="utf-8"), max_size=20)
_surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1,
                      max_size=2)
_TEXTS = [_ascii] * 8 + [_utf8] * 4 + [st.sampled_from(_ODD_TEXT)] * 3 + [_surrogates]
text = st.sampled_from(_TEXTS).flatmap(lambda s: s)
_EDGE_INTS = [0, 1, -1, 2, 3, 4, 127, 128, 129, 2**31 - 1, 2**31, 2**53 + 1, 2**63, -2**63,
              10**30]
ints = st.one_of(st.integers(-3, 40), st.sampled_from(_EDGE_INTS), st.integers())
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, -0.0, 1e-308, 5e-324, 1e308, 2.0, 2.0000001]))
scalar = st.one_of(st.none(), st.booleans(), ints, floats, text)
anything = st.recursive(scalar, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(text, c, max_size=4)), max_leaves=12)


def _or_wrong(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``valid`` nine times in ten, else any JSON value."""
    return st.sampled_from([valid] * 9 + [anything]).flatmap(lambda s: s)


small_cap = st.one_of(st.integers(1, 24), st.integers(1, 24),
                      st.sampled_from([0, -1, 25, 4096, 10**9, 2**63]))
image_part = st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries(
    {"url": st.sampled_from(["data:image/png;base64,iVBORw0KGgo=", "https://example.invalid/a.png",
                             "", "data:,"])})})
content_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _or_wrong(text)}), image_part,
    st.fixed_dictionaries({"type": st.just("input_audio"),
                           "input_audio": st.fixed_dictionaries({"data": text, "format": text})}),
    anything)
message = st.fixed_dictionaries(
    {"role": _or_wrong(st.sampled_from(["system", "developer", "user", "assistant", "tool"])),
     "content": _or_wrong(st.one_of(text, st.lists(content_part, max_size=3), st.none()))},
    optional={"name": _or_wrong(text), "tool_call_id": text,
              "tool_calls": st.lists(anything, max_size=2)})
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": _or_wrong(text)}, optional={"parameters": anything, "description": text})})
token_ids = st.lists(st.one_of(st.integers(0, 300_000), ints), min_size=0, max_size=40)

#: every OpenAI field, with valid (or nearly valid) values; :func:`json_body` makes some
#: of them wrong
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": small_cap,
    "max_completion_tokens": small_cap,
    "n": st.integers(1, 3) | st.sampled_from([0, 128, 129]),
    "best_of": st.integers(1, 3),
    "temperature": st.floats(0, 2) | st.sampled_from([-0.1, 2.1]),
    "top_p": st.floats(0, 1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "logit_bias": st.dictionaries(st.integers(0, 300_000).map(str) | text,
                                  st.integers(-100, 100) | floats, max_size=4),
    "logprobs": st.booleans() | st.integers(0, 5),
    "top_logprobs": st.integers(0, 20),
    "tools": st.lists(tool, max_size=3),
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | tool,
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                        {"type": "json_schema", "json_schema": {}}]),
    "stop": text | st.lists(text, max_size=4),
    "seed": ints,
    "presence_penalty": floats, "frequency_penalty": floats,
    "user": text, "echo": st.booleans(), "suffix": text,
    "cache_salt": text, "parallel_tool_calls": st.booleans(),
    "metadata": anything,
}
MODELS = st.sampled_from([MODEL] * 8 + ["", "gpt-4o", MODEL + " "])
PROMPTS = st.one_of(text, st.lists(text, min_size=1, max_size=3), token_ids,
                    st.lists(token_ids, min_size=1, max_size=3))


@st.composite
def json_body(draw: st.DrawFn, chat: bool) -> dict[str, Any]:
    """A chat or completions body: half with every field valid in type, half
    "hostile" (each field wrong one time in ten, and extra unknown keys)."""
    hostile = draw(st.booleans())
    wrap = _or_wrong if hostile else (lambda s: s)
    out: dict[str, Any] = {"model": draw(wrap(MODELS))}
    if chat:
        out["messages"] = draw(wrap(st.lists(message, min_size=1, max_size=4)))
    else:
        out["prompt"] = draw(wrap(PROMPTS))
    for name in draw(st.sets(st.sampled_from(sorted(FIELDS)), max_size=6)):
        out[name] = draw(wrap(FIELDS[name]))
    if hostile:
        out.update(draw(st.dictionaries(text, anything, max_size=2)))
    return out


def _raw_bodies() -> st.SearchStrategy[bytes]:
    deep = st.integers(1, 100_000).map(lambda d: b"[" * d + b"]" * d)
    deep_obj = st.integers(1, 3000).map(
        lambda d: b'{"model":"' + MODEL.encode() + b'","messages":[{"role":"user","content":'
        + b'{"a":' * d + b"1" + b"}" * d + b"}]}")
    dup = st.sampled_from([
        b'{"model":"sim-model","model":"other","messages":[{"role":"user","content":"hi"}]}',
        b'{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":4,'
        b'"max_tokens":100000}',
        b'{"model":"sim-model","prompt":"x","stream":true,"stream":false,"max_tokens":3}',
        b'{"model":"sim-model","prompt":"x","n":1,"n":3,"max_tokens":5}'])
    odd = st.sampled_from([
        b"", b"null", b"[]", b'"x"', b"{", b'{"model":', b"\xff\xfe{}", b"\xef\xbb\xbf{}",
        b'{"model":"sim-model","prompt":"x","max_tokens":1e999999}',
        b'{"model":"sim-model","prompt":"x","max_tokens":NaN}',
        b'{"model":"sim-model","prompt":"x","max_tokens":-0}',
        b'{"model":"sim-model","prompt":"x","max_tokens":' + b"9" * 5000 + b"}",
        b'{"model":"sim-model","prompt":"\\ud800"}',
        b'{"model":"sim-model","prompt":"\xc3\x28"}'])
    return st.one_of(deep, deep_obj, dup, odd, st.binary(max_size=64))


@dataclass(frozen=True)
class FuzzRequest:
    """One generated request: ``path``, ``headers`` and the body as sent (bytes)."""

    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def streamed(self) -> bool:
        try:
            return json.loads(self.body).get("stream") is True
        except (ValueError, AttributeError, RecursionError):
            return False


def _encode(body: Any) -> bytes:
    # ensure_ascii: lone surrogates become \\udXXX escapes; NaN/Infinity as Python writes them
    return json.dumps(body).encode()


_KEYS = [api_key(t["name"]) for t in TENANTS]
auth_headers = st.one_of(
    st.just({}), st.sampled_from(_KEYS).map(lambda k: {"Authorization": f"Bearer {k}"}),
    st.sampled_from(_KEYS).map(lambda k: {"x-api-key": k}),
    st.sampled_from(["Bearer", "Bearer ", "Basic abc", "Bearer wrong-key", "bearer " + _KEYS[0],
                     "Bearer " + "k" * 10_000]).map(lambda v: {"Authorization": v}))
extra_headers = st.dictionaries(
    st.sampled_from(["x-request-timeout", "Cache-Control", "x-session-id", "x-request-id",
                     "Content-Type"]),
    st.sampled_from(["0", "-1", "nan", "inf", "1e308", "0.001", "30", "no-cache", "no-store",
                     "text/plain", "application/json; charset=latin-1", "../../etc",
                     "x" * 300]), max_size=2)


#: one request in this many carries a huge prompt (:func:`huge_body`)
HUGE_ONE_IN = 500
#: huge prompt sizes, bytes: under and over the shipped 8 MiB ``max_body_bytes``
HUGE_BYTES = [1 << 20, 4 << 20, 6_500_000, 8_500_000]


@st.composite
def sequence_body(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """(path, body) multiplying sequences: a completions prompt list of up to 5,000
    prompts or a chat, times ``n`` and ``best_of`` up to 128 (and just over), so the
    products fall on both sides of ``gateway.max_sequences`` (256)."""
    n = draw(st.sampled_from([None, 1, 2, 8, 16, 64, 128, 129]))
    best_of = draw(st.sampled_from([None, 1, 2, 16, 128]))
    body: dict[str, Any] = {"model": MODEL, "max_tokens": draw(st.integers(1, 3)),
                            "stream": draw(st.booleans())}
    if n is not None:
        body["n"] = n
    if best_of is not None:
        body["best_of"] = best_of
    if draw(st.booleans()):
        body["messages"] = [{"role": "user", "content": draw(text)}]
        return "/v1/chat/completions", body
    prompts = draw(st.sampled_from([1, 2, 16, 128, 257, 1000, 5000]))
    ids = draw(st.booleans())
    body["prompt"] = [[7, 8, 9]] * prompts if ids else ["Say hi."] * prompts
    return "/v1/completions", body


@st.composite
def huge_body(draw: st.DrawFn) -> tuple[str, bytes]:
    """(path, body bytes) with one prompt of :data:`HUGE_BYTES` bytes (repeated text,
    ASCII or multi-byte), chat or completions, streamed or not."""
    size = draw(st.sampled_from(HUGE_BYTES))
    word = draw(st.sampled_from(["lorem ipsum ", "日本語のテキスト ", "x"]))
    prompt = word * (size // len(word.encode()))
    stream = draw(st.booleans())
    if draw(st.booleans()):
        body = {"model": MODEL, "max_tokens": 2, "stream": stream,
                "messages": [{"role": "user", "content": prompt}]}
        return "/v1/chat/completions", json.dumps(body, ensure_ascii=False).encode()
    body = {"model": MODEL, "max_tokens": 2, "stream": stream, "prompt": prompt}
    return "/v1/completions", json.dumps(body, ensure_ascii=False).encode()


@st.composite
def requests(draw: st.DrawFn) -> FuzzRequest:
    """A hostile or odd request: mostly chat/completions JSON, some raw bytes, some
    sequence multipliers, a few to the wrong path, rarely a huge prompt."""
    kind = draw(st.sampled_from(["chat"] * 5 + ["completions"] * 4 + ["raw"] * 2
                                + ["sequences"]))
    if draw(st.randoms(use_true_random=False)).randrange(HUGE_ONE_IN) == 0:
        kind = "huge"
    if kind == "huge":
        path, body = draw(huge_body())
    elif kind == "sequences":
        path, obj = draw(sequence_body())
        body = _encode(obj)
    elif kind == "raw":
        body = draw(_raw_bodies())
        path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    else:
        obj = draw(json_body(kind == "chat"))
        if obj.get("stream") is True and draw(st.booleans()):
            obj.setdefault("stream_options", {"include_usage": True})
        body = _encode(obj)
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        path = draw(st.sampled_from([path] * 30 + ["/v1/embeddings", "/v1/chat/completions/"]))
    headers = {**draw(auth_headers), **draw(extra_headers)}
    headers.setdefault("Content-Type", "application/json")
    return FuzzRequest(path, headers, body)


def generate(n: int, seed_value: int) -> list[FuzzRequest]:
    """``n`` examples of :func:`requests` (hypothesis generation only, no shrinking)."""
    out: list[FuzzRequest] = []

    @seed(seed_value)
    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(requests())
    def collect(r: FuzzRequest) -> None:
        out.append(r)

    collect()
    return out[:n]


# ----------------------------------------------------------------------------- checks


@dataclass
class Answer:
    """What came back for one request (status 0: the connection failed)."""

    status: int
    raw: bytes
    trace_id: str
    problems: list[str] = field(default_factory=list)


def check(req: FuzzRequest, ans: Answer) -> list[str]:
    """The per-request invariants broken by ``ans`` (empty: none)."""
    problems = []
    if ans.status == 0:
        problems.append(f"no HTTP answer: {ans.raw[:200]!r}")
    elif is_server_error(ans.status, ans.raw):
        problems.append(f"server error {ans.status}: {ans.raw[:300]!r}")
    if ans.status >= 400:
        if (p := error_problem(ans.status, ans.raw)) is not None:
            problems.append(p)
    elif (ans.status == 200 and req.streamed and ans.raw.startswith(b"data: ")
          and stream_end(ans.raw) == "cut"):
        problems.append(f"stream neither finished nor failed: {ans.raw[-200:]!r}")
    return problems


async def send(session: aiohttp.ClientSession, url: str, req: FuzzRequest,
               timeout_s: float = 60.0) -> Answer:
    trace_id, tp = new_trace()
    try:
        async with session.post(url + req.path, data=req.body, headers={**req.headers, **tp},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            raw = await r.read()
            ans = Answer(r.status, raw, trace_id)
    except (aiohttp.ClientError, TimeoutError) as e:
        ans = Answer(0, repr(e).encode(), trace_id)
    ans.problems = check(req, ans)
    return ans


def describe(req: FuzzRequest, ans: Answer) -> str:
    headers = {k: v if len(v) < 80 else v[:40] + f"…({len(v)} chars)" for k, v in req.headers.items()}
    return (f"POST {req.path} headers={headers!r} body={req.body[:600]!r}"
            f"{'…' if len(req.body) > 600 else ''} -> {ans.status}: {ans.problems}")


# ----------------------------------------------------------------------------- run


def stand_config(directory: Path, otlp_endpoint: str, *, engines: int = 2,
                 speed: float = 50.0) -> Path:
    """The fuzz stand: ``engines`` simulators at ``speed`` × the CPU profile that
    compress their answers when asked (``--compress``), tracing to ``otlp_endpoint``,
    the :data:`TENANTS`."""
    return write_config(
        directory, engines=sim_engines(engines, speed, "--compress"), tenants=TENANTS,
        gateway={"observability": {"access_log": False, "tracing": True,
                                   "otlp_endpoint": otlp_endpoint},
                 "timeouts": {"request_body_s": 5}},
        saturation={"max_waiting": 1000})


async def run(args: argparse.Namespace) -> dict[str, Any]:
    reqs = generate(args.requests, args.seed)
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="sluice-fuzz-"))
    sink = await TraceSink().start()
    trace_env()
    answers: list[tuple[FuzzRequest, Answer]] = []
    try:
        cfg = stand_config(out_dir / "config", sink.url, speed=args.speed)
        with gateway(cfg, log_path=out_dir / "gateway.log", ready_timeout_s=60) as gw:
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn) as session:
                sem = asyncio.Semaphore(args.concurrency)
                t0 = time.monotonic()

                async def one(r: FuzzRequest) -> None:
                    async with sem:
                        answers.append((r, await send(session, gw.url, r)))

                left: dict[str, float] = {}
                for start in range(0, len(reqs), args.batch):
                    await asyncio.gather(*(one(r) for r in reqs[start:start + args.batch]))
                    left = await settled(session, gw.url, gw.engine_urls(), timeout_s=10)
                    if left:
                        print(f"after requests {start}-{start + args.batch - 1}: left held "
                              f"{left}", file=sys.stderr)
                wall = time.monotonic() - t0
                missing = await sink.wait_for([a.trace_id for _, a in answers], timeout_s=15)
    finally:
        await sink.stop()
    with (out_dir / "answers.jsonl").open("w") as f:
        for r, a in answers:
            f.write(json.dumps({"path": r.path, "body": r.body[:300].decode("utf-8", "replace"),
                                "status": a.status, "answer": a.raw[:300].decode("utf-8", "replace"),
                                "problems": a.problems}) + "\n")
    traced = [sink.traces[a.trace_id] for _, a in answers if a.trace_id in sink.traces]
    over = [(r, a, sink.traces[a.trace_id]) for r, a in answers
            if a.trace_id in sink.traces and sink.traces[a.trace_id].overshoot > 0]
    bad = [(r, a) for r, a in answers if a.problems]
    print(f"{len(answers)} requests in {wall:.1f} s; {len(bad)} broke an invariant; "
          f"{len(over)} overshot their reservation "
          f"({sum(t.output_tokens > (t.reserved or 0) for _, _, t in over)} by output alone); "
          f"leftovers {left}; "
          f"{len(missing)} without a trace (of {len(traced)} traced)", file=sys.stderr)
    for r, a in bad[:args.examples]:
        print("INVARIANT " + describe(r, a), file=sys.stderr)
    for r, a, t in over[:args.examples]:
        print(f"OVERSHOOT reserved {t.reserved} < in {t.input_tokens} + out {t.output_tokens}: "
              + describe(r, a), file=sys.stderr)
    return {
        "requests": len(answers),
        "status_counts": dict(sorted(Counter(str(a.status) for _, a in answers).items())),
        "server_errors": sum(is_server_error(a.status, a.raw) or a.status == 0
                             for _, a in answers),
        "leaked_slots": sum(left.values()),
        "overshoot_tokens": sum(t.overshoot for t in traced),
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest fuzz",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--json", required=True, help="report path")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    p.add_argument("--batch", type=int, default=250,
                   help="requests between two leftover checks (the gateway idle)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speed", type=float, default=50.0, help="simulator speed factor")
    p.add_argument("--examples", type=int, default=20, help="failing examples printed")
    p.add_argument("--out-dir", help="config and gateway log (default: a temp dir)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    write_json(args.json, asyncio.run(run(args)))
    return 0
