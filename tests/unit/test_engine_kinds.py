"""Each dialect's parser (engines.kinds) on recorded metric pages, and every dialect of
the simulator mapped back onto one load.

Pages: ``tests/fixtures/llamacpp_0.3.36_metrics_busy.txt`` was captured from the real
``llama-server`` built by ``make llama-server`` (the e2e test's engine, while it served
requests); ``tests/fixtures/sim_<dialect>_metrics_busy.*`` were recorded from the
simulator's dialects (``loadtest/sim_engine/dialects.py``) on :func:`busy_engine`'s
state — re-record with ``python -m tests.unit.test_engine_kinds``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from config.loader import load_config
from engines.blocks import chain_block_hashes
from engines.kinds import KINDS, SIGNALS
from loadtest.sim_engine.dialects import DIALECTS
from loadtest.sim_engine.engine import SimEngine
from loadtest.sim_engine.profiles import CPU_GEMMA3_270M_QUIET
from loadtest.sim_engine.scheduler import SimRequest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CONFIG = Path(__file__).resolve().parents[2] / "config"


def busy_engine() -> SimEngine:
    """A simulated engine mid-work: 3 running (``max_num_seqs``), 2 waiting, 12 of 64
    usable 16-token blocks in use, 128 of 282 prompt tokens from the prefix cache."""
    p = CPU_GEMMA3_270M_QUIET.with_overrides(num_blocks=65, block_size=16, max_num_seqs=3,
                                       max_model_len=512, max_num_batched_tokens=4096)
    engine = SimEngine(p, "gemma3-270m")
    shared = list(range(64))
    for i in range(5):
        tokens = shared + [1000 + i] * (20 + 10 * i)
        engine.scheduler.add(SimRequest(f"r{i}", len(tokens),
                                        chain_block_hashes(tokens, 16, None), 50))
    for step in range(4):
        engine.scheduler.commit(engine.scheduler.schedule(), float(step))
    return engine


def _page(dialect: str) -> str:
    return next(FIXTURES.glob(f"sim_{dialect}_metrics_busy.*")).read_text()


def test_sglang_recorded_page() -> None:
    snap = KINDS["sglang"].parse(_page("sglang"), 7.0, None)
    assert snap.at == 7.0
    assert (snap.num_running, snap.num_waiting) == (3, 2)
    assert snap.kv_cache_usage == pytest.approx(0.1875)
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (282.0, 128.0)
    assert (snap.block_size, snap.num_blocks) == (1, 1024)  # token pool, page size 1
    assert snap.signals == frozenset(SIGNALS)


def test_tgi_recorded_page_has_no_kv_signals() -> None:
    snap = KINDS["tgi"].parse(_page("tgi"), 1.0, None)
    assert (snap.num_running, snap.num_waiting) == (3, 2)
    assert snap.kv_cache_usage is None and snap.block_size is None
    assert snap.signals == {"running", "waiting"}


def test_trtllm_recorded_json() -> None:
    snap = KINDS["trtllm"].parse(_page("trtllm"), 1.0, None)
    assert (snap.num_running, snap.num_waiting) == (3, 2)
    assert snap.kv_cache_usage == pytest.approx(12 / 64)
    assert (snap.block_size, snap.num_blocks) == (16, 64)
    assert snap.prefix_cache_hits == 8 * 16  # reusedBlocks × tokensPerBlock
    assert snap.prefix_cache_queries == (8 + 9) * 16
    assert snap.signals == frozenset(SIGNALS)


def test_trtllm_empty_list_is_idle_and_keeps_kv_geometry() -> None:
    busy = KINDS["trtllm"].parse(_page("trtllm"), 1.0, None)
    idle = KINDS["trtllm"].parse("[]", 2.0, busy)
    assert (idle.at, idle.num_running, idle.num_waiting) == (2.0, 0, 0)
    assert (idle.block_size, idle.num_blocks) == (16, 64)
    assert idle.prefix_cache_hits == busy.prefix_cache_hits
    with pytest.raises(ValueError):
        KINDS["trtllm"].parse('{"iter": 1}', 3.0, None)
    assert json.loads(_page("trtllm"))[0]["kvCacheStats"]["usedNumBlocks"] == 12


def test_llamacpp_simulated_page() -> None:
    snap = KINDS["llamacpp"].parse(_page("llamacpp"), 1.0, None)
    assert (snap.num_running, snap.num_waiting) == (3, 2)
    assert snap.prefix_cache_hits == 128.0
    assert snap.prefix_cache_queries == 282.0  # evaluated (154) + cached (128)
    assert snap.generation_tokens == 12.0
    assert snap.kv_cache_usage is None
    assert snap.signals == {"running", "waiting", "prefix_hits"}


def test_llamacpp_real_page() -> None:
    """Captured from the built llama-server (``--parallel 4``) with 5 completions of
    120 tokens in flight after an earlier wave: 4 slots busy, 3 tasks deferred."""
    text = (FIXTURES / "llamacpp_0.3.36_metrics_busy.txt").read_text()
    snap = KINDS["llamacpp"].parse(text, 1.0, None)
    assert snap.signals == {"running", "waiting", "prefix_hits"}
    assert (snap.num_running, snap.num_waiting) == (4, 3)
    assert snap.generation_tokens == 805.0
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (83.0 + 24.0, 24.0)
    assert snap.kv_cache_usage is None and snap.block_size is None


def test_llamacpp_slots_from_props() -> None:
    """``GET /props`` of llama-server (``get_res_props``, llama-cpp-python 0.3.36 tree):
    ``total_slots`` is ``--parallel``; anything else is no slot count."""
    parse = KINDS["llamacpp"].parse_slots
    assert KINDS["llamacpp"].slots_path == "/props" and parse is not None
    assert parse({"total_slots": 4, "model_alias": "gemma3-270m"}) == 4
    for bad in ({}, {"total_slots": 0}, {"total_slots": "4"}, {"total_slots": True}, [4]):
        assert parse(bad) is None
    assert all(k.slots_path is None for n, k in KINDS.items() if n != "llamacpp")


@pytest.mark.parametrize("dialect", ["vllm", "llamacpp", "sglang", "tgi", "trtllm"])
def test_every_dialect_reads_back_the_same_load(dialect: str) -> None:
    """One engine state, each dialect's page, each parser: the same running and
    waiting, and the same KV usage and prefix hits where the dialect reports them."""
    engine = busy_engine()
    body, _ = DIALECTS[dialect].render(engine)  # type: ignore[misc]
    snap = KINDS[dialect].parse(body.decode(), 0.0, None)
    s = engine.scheduler
    assert (snap.num_running, snap.num_waiting) == (len(s.running), len(s.waiting))
    assert snap.signals == KINDS[dialect].signals
    if "kv_usage" in snap.signals:
        assert snap.kv_cache_usage == pytest.approx(engine.kv.usage)
    if "prefix_hits" in snap.signals:
        assert snap.prefix_cache_hits == s.counters.prefix_cache_hits


def test_page_without_known_signals_reports_none() -> None:
    assert KINDS["sglang"].parse("# nothing here\n", 0.0, None).signals == frozenset()
    assert KINDS["vllm"].parse("other_metric 1\n", 0.0, None).signals == frozenset()
    assert KINDS["openai"].metrics_path is None


@pytest.mark.parametrize("name", ["engines-llamacpp-fallback.yaml",
                                  "engines-mixed-external.yaml"])
def test_example_configs_load(name: str) -> None:
    """The shipped examples load with the shipped gateway and tenants files (fallback
    model served, dialects known)."""
    cfg = load_config(engines=CONFIG / "examples" / name)
    dialects = {s.name: s.engine_dialect for s in cfg.engines.engines}
    assert set(dialects.values()) <= set(KINDS)
    if name == "engines-llamacpp-fallback.yaml":
        assert dialects == {"gemma-vllm": "vllm", "gemma-llamacpp": "llamacpp"}
        fallback = cfg.engines.model_settings("gemma3-270m").degradation.fallback_model
        assert fallback == "gemma3-270m-cpu"
    else:
        assert dialects["bare-0"] == "openai" and dialects["vllm-0"] == "vllm"


def _record() -> None:
    engine = busy_engine()
    for name, dialect in DIALECTS.items():
        if dialect.render is None or name == "vllm":  # vLLM's page is the real engine's
            continue
        body, content_type = dialect.render(engine)
        ext = "json" if "json" in content_type else "txt"
        (FIXTURES / f"sim_{name}_metrics_busy.{ext}").write_bytes(body)


if __name__ == "__main__":
    _record()
