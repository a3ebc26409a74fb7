"""Per-dialect request quirks through the gateway: streams to a llama.cpp engine go
with ``Connection: close`` (llama-server drops the connection after a stream while
announcing keep-alive, so a pooled connection would be dead), other requests and other
dialects keep their pooled connections."""

from __future__ import annotations

from config.schema import Config, EnginesConfig
from tests.integration.conftest import FAST_SUPERVISOR, make_config, run_gateway

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


def _with_dialects(cfg: Config, dialects: list[str]) -> Config:
    specs = [{**s.model_dump(exclude_defaults=True), "dialect": d}
             for s, d in zip(cfg.engines.engines, dialects, strict=True)]
    engines = EnginesConfig.model_validate({"engines": specs, "supervisor": FAST_SUPERVISOR})
    return cfg.model_copy(update={"engines": engines})


async def test_llamacpp_streams_close_the_connection(engines) -> None:
    llama, vllm = await engines(2)
    llama.model, vllm.model = "llama-model", "vllm-model"  # one engine per model
    cfg = _with_dialects(make_config([llama, vllm]), ["llamacpp", "vllm"])
    async with run_gateway(cfg) as gw:
        for model in ("llama-model", "vllm-model"):
            for stream in (True, False, True, False):
                r = await gw.post("/v1/chat/completions",
                                  {**CHAT, "model": model, "stream": stream})
                assert r.status == 200
                await r.read()
    def connection(engine, stream: bool) -> set[str]:
        return {h.get("Connection", "keep-alive").lower()
                for b, h in zip(engine.received, engine.headers, strict=True)
                if bool(b.get("stream")) is stream}

    assert connection(llama, True) == {"close"}
    assert connection(llama, False) == {"keep-alive"}
    assert connection(vllm, True) == connection(vllm, False) == {"keep-alive"}
