"""End to end: ``sluice serve`` with the shipped default config launches a real CPU
vLLM engine on the packaged Gemma 3 270M; the ``openai`` SDK talks to the gateway.

The model is a base model: tests check structure, usage and behaviour, never content.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator

import httpx
import openai
import psutil
import pytest

from loadtest.launch import RunningGateway, gateway
from tests.support import wait_for_sync

pytestmark = pytest.mark.slow
MODEL = "gemma3-270m"


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[RunningGateway]:
    log = tmp_path_factory.mktemp("gw") / "gateway.log"
    with gateway(log_path=log) as gw:
        children = psutil.Process(gw.proc.pid).children(recursive=True)
        yield gw
    _gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"orphan engine processes after SIGTERM: {alive}"


@pytest.fixture
def client(served: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="sk-sluice-local", max_retries=0)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL, "all-minilm-l6-v2"]


def test_chat(client):
    r = client.chat.completions.create(model=MODEL, max_tokens=8,
                                       messages=[{"role": "user", "content": "Say hi"}])
    assert r.choices[0].finish_reason in ("stop", "length")
    assert isinstance(r.choices[0].message.content, str)
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 8


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=8, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Count to five"}])
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 8 or any(
        c.choices and c.choices[0].finish_reason == "stop" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(text, str)


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5)
    assert r.usage.completion_tokens <= 5 and r.choices[0].finish_reason in ("stop", "length")


def test_wrong_key_is_authentication_error(served):
    bad = openai.OpenAI(base_url=served.url + "/v1", api_key="sk-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def _running(engine_url: str) -> float:
    text = httpx.get(engine_url + "/metrics", timeout=5).text
    m = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert m, "vllm:num_requests_running missing"
    return float(m.group(1))


def test_client_disconnect_lowers_engine_running(served):
    (engine,) = served.engine_urls(MODEL)
    body = {"model": MODEL, "max_tokens": 1500, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Write a long story."}]}
    with httpx.Client(timeout=30) as http, \
            http.stream("POST", served.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for _ in r.iter_raw():
            if _running(engine) >= 1:
                break
    wait_for_sync(lambda: _running(engine) == 0, 2.0, "vLLM to abort the request")


def test_engine_killed_is_restarted(served, client):
    (victim,) = [p for p in served.engine_processes() if MODEL in " ".join(p.cmdline())]
    victim.send_signal(signal.SIGKILL)
    wait_for_sync(lambda: httpx.get(served.url + "/ready", timeout=2).status_code == 503, 30,
                  "the killed engine to be marked unhealthy")
    served.wait_ready(300)
    assert all(p.pid != victim.pid for p in served.engine_processes())
    r = client.chat.completions.create(model=MODEL, max_tokens=4,
                                       messages=[{"role": "user", "content": "Hi again"}])
    assert r.usage.completion_tokens > 0
