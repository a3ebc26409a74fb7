"""The simulator's KV cache: a pool of fixed-size blocks with hash-keyed prefix
caching and LRU eviction of free blocks, as vLLM v1 manages GPU KV memory.

Sources: ``vllm/v1/core/block_pool.py`` (``BlockPool``: a free-block queue ordered
for eviction, a hash → block map of cached full blocks, reference counts, block 0
reserved as the null block, usage = 1 − free / (num_blocks − 1)) and
``vllm/v1/core/kv_cache_manager.py`` (``get_computed_blocks``: the longest run of
cached leading blocks, capped at ``num_tokens − 1`` so the last prompt token is always
recomputed; ``allocate_slots``; ``free`` releasing a request's blocks tail first so
that the tail of a prompt is evicted before its shared head).

With ``events=True`` it also queues vLLM's KV-cache events
(``vllm/v1/core/block_pool.py``: ``BlockStored`` when full blocks enter the prefix
cache, with their token ids, parent hash and the ``cache_salt`` as the first block's
extra key; ``BlockRemoved`` when a cached block is evicted for reuse) for the engine
to publish after each step (:meth:`KVCache.take_events`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engines.kv_events import BlockRemoved, BlockStored, Event

#: The ``medium`` vLLM's block pool reports (``MEDIUM_GPU`` in ``kv_events.py``).
MEDIUM = "GPU"


@dataclass(eq=False)
class Block:
    """One KV block: ``ref_cnt`` running requests use it; ``block_hash`` is set
    once it is full and registered in the prefix cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class KVCache:
    """``num_blocks`` blocks of ``block_size`` tokens (block 0 is the null block and
    never used, as in vLLM).

    Free blocks (ref count 0) sit in an LRU queue, oldest first: allocation takes the
    head and, if that block is cached, evicts it from the prefix cache. A cached free
    block that a new request matches is taken out of the queue again (a hit).
    """

    def __init__(self, num_blocks: int, block_size: int, events: bool = False) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError("need num_blocks >= 2 and block_size >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict(
            (b.block_id, b) for b in self._blocks[1:])
        self._cached: dict[int, Block] = {}
        self.evictions = 0
        self._events: list[Event] | None = [] if events else None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached or not."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """``vllm:kv_cache_usage_perc``: fraction 0–1 of usable blocks held by
        requests (``BlockPool.get_usage``)."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def longest_prefix(self, block_hashes: Sequence[int], num_tokens: int) -> list[Block]:
        """Cached blocks matching the leading ``block_hashes``, at most
        ``(num_tokens − 1) // block_size`` of them (vLLM recomputes the last token
        to get logits, so a fully cached prompt still computes its last block)."""
        limit = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        hits: list[Block] = []
        for h in block_hashes[:limit]:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def touch(self, blocks: Sequence[Block]) -> None:
        """Take a reference on each of ``blocks`` (prefix hits)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[Block] | None:
        """``n`` new blocks (ref count 1), evicting cached free blocks LRU-first; None
        (and nothing taken) if fewer than ``n`` are free."""
        if n > len(self._free):
            return None
        out: list[Block] = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                    if self._events is not None:
                        self._events.append(BlockRemoved([block.block_hash], MEDIUM))
                block.block_hash = None
                self.evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference from each of ``blocks``; blocks reaching 0 join the
        LRU queue tail-block first, so a request's last blocks are evicted first."""
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_blocks(self, blocks: Sequence[Block], block_hashes: Sequence[int],
                     parent: int | None = None, token_ids: Sequence[int] = (),
                     salt: str | None = None) -> None:
        """Register full ``blocks`` under ``block_hashes`` (pairwise). A hash already
        cached keeps its existing block; the duplicate stays uncached.

        For events: ``parent`` is the hash of the block before ``blocks[0]`` (None
        at the prompt's start), ``token_ids`` the blocks' tokens
        (``block_size`` each), ``salt`` the request's ``cache_salt``. One
        ``BlockStored`` is queued per run of newly cached blocks."""
        run: list[int] = []  # indexes of the current run of newly cached blocks
        for i, (block, h) in enumerate(zip(blocks, block_hashes, strict=False)):
            if block.block_hash is None and h not in self._cached:
                block.block_hash = h
                self._cached[h] = block
                if self._events is not None:
                    if run and run[-1] != i - 1:
                        self._stored(run, block_hashes, parent, token_ids, salt)
                        run = []
                    run.append(i)
        if run:
            self._stored(run, block_hashes, parent, token_ids, salt)

    def _stored(self, run: list[int], hashes: Sequence[int], parent: int | None,
                token_ids: Sequence[int], salt: str | None) -> None:
        assert self._events is not None
        first, bs = run[0], self.block_size
        root = first == 0 and parent is None
        extra: list[tuple[str, ...] | None] = [None] * len(run)
        if root and salt:
            extra[0] = (salt,)
        self._events.append(BlockStored(
            block_hashes=[hashes[i] for i in run],
            parent_block_hash=hashes[first - 1] if first else parent,
            token_ids=list(token_ids[first * bs:(run[-1] + 1) * bs]), block_size=bs,
            lora_id=None, medium=MEDIUM, lora_name=None, extra_keys=extra))

    def take_events(self) -> list[Event]:
        """The events queued since the last call (empty without ``events``)."""
        if not self._events:
            return []
        out, self._events = self._events, []
        return out
