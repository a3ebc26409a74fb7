"""Prompt rendering and chained block hashing on the request path
(engines.prompt): equality with the simulator, the real Gemma template, salts, cost."""

from __future__ import annotations

import time

import pytest

from config.schema import EnginesConfig
from engines.blocks import chain_block_hashes, fallback_tokenize
from engines.pool import Engine, EnginePool, MetricsSnapshot
from engines.prompt import (
    DEFAULT_BLOCK_SIZE,
    FallbackEncoder,
    HFEncoder,
    PromptBlocks,
    PromptInput,
    cache_salt,
    encoder_for,
    local_model_folder,
    render_fallback_chat,
)
from loadtest.sim_engine.protocol import parse_chat, parse_completion
from loadtest.sim_engine.server import _tokens_and_hashes
from loadtest.workloads.base import synthetic_text

MESSAGES = [
    {"role": "system", "content": "You are terse. " * 40},
    {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text",
                                                                       "text": "there."}]},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": synthetic_text("q", 300)},
]


def engines_cfg(kind: str = "sim", **prefix) -> EnginesConfig:
    spec = {"name": "e", "model": "m", "kind": kind}
    if kind == "external":
        spec["url"] = "http://127.0.0.1:1"
    if kind == "vllm":
        spec["model_path"] = "packaged:gemma3-270m"
    return EnginesConfig.model_validate({"engines": [spec], "scheduler": {"prefix": prefix}})


def pool_with_block_size(block_size: int | None) -> EnginePool:
    e = Engine(id="e", model="m", base_url="http://e")
    if block_size:
        e.metrics = MetricsSnapshot(at=0.0, block_size=block_size, num_blocks=100)
    return EnginePool([e])


@pytest.mark.parametrize("salt", [None, "tenant:a"])
def test_sim_engine_blocks_equal_gateway_blocks(salt) -> None:
    """For kind: sim the gateway computes exactly the simulator's block hashes."""
    pb = PromptBlocks(engines_cfg("sim"), pool_with_block_size(16))
    chat = {"model": "m", "messages": MESSAGES, **({"cache_salt": salt} if salt else {})}
    _, sim_hashes = _tokens_and_hashes(parse_chat(chat, "m"), 16)
    assert pb.blocks_sync("m", PromptInput.from_body(chat), salt) == tuple(sim_hashes)
    assert len(sim_hashes) > 20
    comp = {"model": "m", "prompt": synthetic_text("p", 100),
            **({"cache_salt": salt} if salt else {})}
    _, sim_hashes = _tokens_and_hashes(parse_completion(comp, "m"), 16)
    assert pb.blocks_sync("m", PromptInput.from_body(comp), salt) == tuple(sim_hashes)
    ids = {"model": "m", "prompt": list(range(40))}
    assert pb.blocks_sync("m", PromptInput.from_body(ids), None) == tuple(
        chain_block_hashes(list(range(40)), 16))


def test_fallback_template_shape() -> None:
    text = render_fallback_chat([{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "yo"}])
    assert text == ("<bos><start_of_turn>user\nhi<end_of_turn>\n"
                    "<start_of_turn>model\nyo<end_of_turn>\n<start_of_turn>model\n")


def test_shared_leading_messages_share_leading_blocks() -> None:
    pb = PromptBlocks(engines_cfg("sim"), pool_with_block_size(16))
    a = pb.blocks_sync("m", PromptInput(messages=MESSAGES), None)
    b = pb.blocks_sync("m", PromptInput(messages=[*MESSAGES[:3], {"role": "user",
                                                                   "content": "other"}]), None)
    shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(b))
    assert shared >= len(b) - 1 >= 10  # the system prompt and first turns
    assert len(a) > len(b) + 10


def test_salt_separates_every_block_and_is_deterministic() -> None:
    pb = PromptBlocks(engines_cfg("sim"), pool_with_block_size(16))
    p = PromptInput(messages=MESSAGES)
    a, b = pb.blocks_sync("m", p, "tenant:a"), pb.blocks_sync("m", p, "tenant:b")
    assert not set(a) & set(b)
    assert a == pb.blocks_sync("m", p, "tenant:a")


def test_block_size_configured_then_metric_then_default() -> None:
    p = PromptInput(prompt=synthetic_text("x", 512))
    assert PromptBlocks(engines_cfg("sim"), pool_with_block_size(None)).block_size("m") \
        == DEFAULT_BLOCK_SIZE
    pb = PromptBlocks(engines_cfg("sim"), pool_with_block_size(128))
    assert pb.block_size("m") == 128 and len(pb.blocks_sync("m", p, None)) == 4
    pb = PromptBlocks(engines_cfg("sim", block_size=64), pool_with_block_size(128))
    assert pb.block_size("m") == 64 and len(pb.blocks_sync("m", p, None)) == 8
    pb = PromptBlocks(engines_cfg("sim", block_size=64, max_blocks=3), pool_with_block_size(0))
    assert len(pb.blocks_sync("m", p, None)) == 3


def test_encoder_choice_by_kind() -> None:
    assert isinstance(encoder_for(engines_cfg("sim").engines[0]), FallbackEncoder)
    assert isinstance(encoder_for(engines_cfg("external").engines[0]), FallbackEncoder)
    vllm = engines_cfg("vllm").engines[0]
    expected = HFEncoder if local_model_folder(vllm) else FallbackEncoder
    assert isinstance(encoder_for(vllm), expected)


def test_cache_salt_values() -> None:
    assert cache_salt("tenant:a") == "tenant:a"
    assert cache_salt("tenant:a", "conv") == "tenant:a.conv"
    hashed = cache_salt("team/shared")  # '/' is refused by vLLM
    assert hashed.startswith("h-") and len(hashed) <= 128 and "/" not in hashed
    assert cache_salt("x" * 200) != cache_salt("x" * 201)


async def test_async_blocks_never_raise() -> None:
    class Broken:
        offload = False

        def encode_chat(self, messages):
            raise ValueError("bad template input")

        def encode_text(self, text):
            raise ValueError("bad")

    pb = PromptBlocks(engines_cfg("sim"), pool_with_block_size(16), encoders={"m": Broken()})
    assert await pb.blocks("m", PromptInput(messages=MESSAGES), None) == ()


@pytest.mark.load
def test_cost_per_request_is_small(capsys) -> None:
    """Rendering + tokenising + hashing a ~1,000-token chat with the fallback."""
    pb = PromptBlocks(engines_cfg("sim"), pool_with_block_size(16))
    p = PromptInput(messages=MESSAGES)
    pb.blocks_sync("m", p, "t")
    n, t0 = 200, time.perf_counter()
    for _ in range(n):
        pb.blocks_sync("m", p, "t")
    us = (time.perf_counter() - t0) / n * 1e6
    tokens = len(fallback_tokenize(render_fallback_chat(MESSAGES)))
    with capsys.disabled():
        print(f"\nprompt blocks (fallback): {us:.0f} µs per {tokens}-token request")
    assert us < 5_000  # generous for a loaded CI machine; ~300 µs here


@pytest.mark.skipif(local_model_folder(engines_cfg("vllm").engines[0]) is None,
                    reason="prepared gemma3-270m model not present")
def test_gemma_template_and_tokenizer_match_transformers(capsys) -> None:
    folder = local_model_folder(engines_cfg("vllm").engines[0])
    enc = HFEncoder(folder)
    text = enc.render_chat(MESSAGES)
    assert text.startswith("<bos><start_of_turn>user\nYou are terse.")  # system folded in
    assert text.endswith("<start_of_turn>model\n")
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert text == tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    # vLLM's chat endpoint: render, then tokenize without adding special tokens
    assert enc.encode_chat(MESSAGES) == tok.encode(text, add_special_tokens=False)
    assert enc.encode_text("Hi there") == tok.encode("Hi there")
    t0, n = time.perf_counter(), 50
    for _ in range(n):
        enc.encode_chat(MESSAGES)
    with capsys.disabled():
        print(f"\nprompt tokens (gemma tokenizer): "
              f"{(time.perf_counter() - t0) / n * 1e6:.0f} µs per request")


def test_tokenizer_field_chooses_the_encoder(tmp_path) -> None:
    sim = engines_cfg("sim").engines[0]
    assert sim.tokenizer_source == "fallback"
    (tmp_path / "tokenizer.json").write_text("{}")
    own = sim.model_copy(update={"tokenizer": str(tmp_path)})
    assert local_model_folder(own) == tmp_path  # a sim engine may name a real tokenizer
    vllm = engines_cfg("vllm").engines[0]
    assert vllm.tokenizer_source == vllm.model_path
    forced = vllm.model_copy(update={"tokenizer": "fallback"})
    assert local_model_folder(forced) is None
    assert isinstance(encoder_for(forced), FallbackEncoder)
