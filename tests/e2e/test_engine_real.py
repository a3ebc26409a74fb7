"""The real CPU vLLM engine, launched and restarted by the Supervisor with the
packaged Gemma 3 270M (prepared into the default model cache if needed).

Slow: one engine start is ~40–60 s on this machine; the file takes ~2–3 minutes.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from config.schema import EnginesConfig
from engines.health import probe_inference
from engines.kinds.vllm import parse_metrics
from engines.pool import EnginePool, EngineState
from engines.prepare import prepare_model
from engines.supervisor import Supervisor, wait_for

pytestmark = pytest.mark.slow

CFG = EnginesConfig.model_validate({
    "engines": [{
        "name": "gemma", "model": "gemma3-270m", "kind": "vllm",
        "model_path": "packaged:gemma3-270m",
        "args": ["--max-model-len", "2048", "--enable-prefix-caching", "-O0"],
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
    }],
    "supervisor": {"startup_grace_s": 240, "probe_interval_s": 1, "probe_timeout_s": 10,
                   "metrics_interval_s": 1, "restart_backoff_s": 0.5,
                   "inference_probe_idle_s": 5, "stop_grace_s": 15},
})


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def test_prepared_model_folder() -> None:
    folder = prepare_model()
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 106]
    assert "<start_of_turn>" in (folder / "chat_template.jinja").read_text()
    assert (folder / "model.safetensors").stat().st_size > 400_000_000
    assert prepare_model() == folder  # idempotent, and instant the second time


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_launch_metrics_sigkill_restart_stop(
    session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    pool = EnginePool()
    sup = Supervisor(CFG, pool, session, run_dir=tmp_path)
    await sup.start()
    try:
        (engine,) = pool.engines
        assert await sup.wait_ready(240), (tmp_path / "gemma.log").read_text()[-3000:]

        assert await wait_for(pool, lambda: engine.metrics is not None, 10)
        snap = engine.metrics
        assert snap.block_size == 128 and snap.num_blocks and snap.num_blocks > 0
        assert snap.kv_cache_usage is not None and 0 <= snap.kv_cache_usage <= 1
        async with session.get(f"{engine.base_url}/metrics") as resp:
            assert parse_metrics(await resp.text(), 0).num_blocks == snap.num_blocks
        assert await probe_inference(session, engine.base_url, engine.model, 30)

        old = sup.runners[0].process.pid
        assert len(group_members(old)) >= 2  # API server + EngineCore
        os.kill(old, signal.SIGKILL)
        assert await wait_for(pool, lambda: engine.state is not EngineState.READY, 5)
        assert await sup.wait_ready(240), (tmp_path / "gemma.log").read_text()[-3000:]
        assert (engine.generation, engine.restarts) == (1, 1)
        assert group_members(old) == []  # the old EngineCore went with its group
        new = sup.runners[0].process.pid
    finally:
        await sup.stop(grace_s=5)
    assert engine.state is EngineState.STOPPED
    assert group_members(new) == []
