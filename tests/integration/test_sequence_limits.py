"""A request may not make the engine generate more than ``gateway.max_sequences``
sequences (prompts × max(n, best_of)), nor more than its tenant's ``max_sequences``:
a 400 in OpenAI's shape naming the parameter, and nothing reaches the engine
(issue 39, item 11: one 17 KB request once put 127,743 sequences into vLLM's queue)."""

from __future__ import annotations

from tests.integration.conftest import make_config, run_gateway
from tests.integration.limits_support import auth, tenant

TENANTS = {"allow_anonymous": True, "tenants": [tenant("few", max_sequences=4)]}


def completions(prompts: int, **fields: int) -> dict:
    prompt = ["Say hi."] * prompts if prompts > 1 else "Say hi."
    return {"model": "fake-model", "prompt": prompt, "max_tokens": 2, **fields}


async def test_sequence_caps(engines) -> None:
    (engine,) = await engines(1)
    cfg = make_config([engine], tenants=TENANTS, gateway={"max_sequences": 64})
    async with run_gateway(cfg) as gw:
        refused = [
            ("/v1/completions", completions(1000, n=128), {}, "prompt"),
            ("/v1/completions", completions(8, n=9), {}, "n"),
            ("/v1/completions", completions(2, n=2, best_of=40), {}, "best_of"),
            ("/v1/chat/completions", {"model": "fake-model", "n": 65, "max_tokens": 2,
                                      "messages": [{"role": "user", "content": "hi"}]},
             {}, "n"),
            ("/v1/completions", completions(1, n=5), auth("few"), "n"),
            ("/v1/completions", completions(5), auth("few"), "prompt"),
        ]
        for path, body, headers, param in refused:
            async with await gw.post(path, body, headers=headers) as r:
                err = (await r.json())["error"]
                assert r.status == 400, (body, err)
                assert err["type"] == "invalid_request_error" and err["param"] == param
                assert "sequences" in err["message"]
        assert engine.received == []
        for path, body, headers in [("/v1/completions", completions(8, n=8), {}),
                                    ("/v1/completions", completions(2, n=2), auth("few"))]:
            async with await gw.post(path, body, headers=headers) as r:
                assert r.status == 200, await r.text()
        assert len(engine.received) == 2
        await gw.idle()
