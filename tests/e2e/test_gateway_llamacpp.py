"""End to end: ``sluice serve`` launches llama.cpp's ``llama-server`` (built by ``make
llama-server``) on the packaged Gemma 3 270M GGUF; the ``openai`` SDK talks to the
gateway, streams with usage, and the engine survives a SIGKILL (the supervisor
restarts it). The model is a base model: structure, usage and behaviour only.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest

from engines.kinds import KINDS
from engines.kinds.llamacpp import server_binary
from loadtest.launch import RunningGateway, gateway, llamacpp_config
from tests.support import wait_for_sync

pytestmark = pytest.mark.slow
MODEL = "gemma3-270m"


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[RunningGateway]:
    if not server_binary().is_file():
        pytest.fail(f"{server_binary()} missing: run `make llama-server` first")
    # the shipped configuration with llama.cpp as its engine; caches off (no embedding model)
    directory = llamacpp_config(tmp_path_factory.mktemp("llamacpp"),
                                {"cache": {"enabled": False}})
    with gateway(directory, log_path=directory / "gateway.log", ready_timeout_s=120) as gw:
        children = psutil.Process(gw.proc.pid).children(recursive=True)
        yield gw
    _gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"orphan engine processes after SIGTERM: {alive}"


@pytest.fixture
def client(served: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="sk-sluice-local", max_retries=0)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5,
                                  temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 5


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=8, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Count to five"}])
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens > 0
    assert 0 < chunks[-1].usage.completion_tokens <= 8
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(text, str)


def test_streams_back_to_back_and_concurrent(client):
    """llama-server drops the connection after each stream: none of these may fail on a
    reused dead connection (the gateway closes it itself)."""
    def stream(i: int) -> int:
        chunks = list(client.chat.completions.create(
            model=MODEL, max_tokens=4, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": f"Number {i}"}]))
        return chunks[-1].usage.completion_tokens

    assert all(stream(i) > 0 for i in range(6))
    with ThreadPoolExecutor(8) as pool:
        assert all(n > 0 for n in pool.map(stream, range(8)))


def test_prompt_over_the_slot_context_is_context_length_exceeded(client):
    """A 2,048-token slot; a ~3,000-token prompt: llama.cpp's 400 maps to our code."""
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="word " * 3000, max_tokens=4)
    assert err.value.code == "context_length_exceeded"


def test_stream_without_usage_gets_none(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, max_tokens=4, stream=True,
        messages=[{"role": "user", "content": "Hi"}]))
    assert all(c.usage is None for c in chunks)
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_real_metrics_page_parses_and_gateway_shows_signals(served, client):
    """The live llama.cpp page through the llamacpp parser; the gateway's
    ``sluice_engine_signals`` shows running/waiting/prefix hits read and no KV usage."""
    (engine,) = served.engine_urls()
    client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    page = httpx.get(engine + "/metrics", timeout=5).text
    snap = KINDS["llamacpp"].parse(page, 0.0, None)
    assert snap.signals == {"running", "waiting", "prefix_hits"}
    assert snap.generation_tokens > 0 and snap.prefix_cache_queries > 0
    text = httpx.get(served.url + "/metrics", timeout=5).text
    shown = dict(re.findall(r'^sluice_engine_signals\{engine="llama",signal="(\w+)"\} (\S+)$',
                            text, re.M))
    assert shown == {"kv_usage": "0.0", "running": "1.0", "waiting": "1.0",
                     "prefix_hits": "1.0", "block_size": "0.0", "num_blocks": "0.0"}


def test_real_props_give_the_slots_that_cap_the_gateway(served, client):
    """The live ``GET /props`` gives ``total_slots`` = the launch's ``--parallel 4``; the
    gateway's concurrency limit for the engine never exceeds it, even with 8 concurrent
    requests (the others wait in the gateway's queue)."""
    (engine,) = served.engine_urls()
    assert KINDS["llamacpp"].parse_slots(httpx.get(engine + "/props", timeout=5).json()) == 4
    limits: list[float] = []

    def one(i: int) -> int:
        out = client.completions.create(model=MODEL, prompt=f"Story {i}:", max_tokens=16)
        text = httpx.get(served.url + "/metrics", timeout=5).text
        limits.extend(float(v) for v in re.findall(
            r'^sluice_engine_(?:concurrency_limit|requests_in_flight)\{engine="llama",'
            r'model="gemma3-270m"\} (\S+)$', text, re.M))
        return out.usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        assert all(n > 0 for n in pool.map(one, range(8)))
    assert limits and max(limits) <= 4, limits


def test_engine_killed_is_restarted(served, client):
    (victim,) = served.engine_processes()
    victim.send_signal(signal.SIGKILL)
    wait_for_sync(lambda: httpx.get(served.url + "/ready", timeout=2).status_code == 503,
                  30, "the killed engine marked unhealthy")
    served.wait_ready(120)
    assert served.engine_processes()[0].pid != victim.pid
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=4, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Hi again"}])
    assert list(stream)[-1].usage.completion_tokens > 0
