"""Deterministic prompt tokenisation fallback and chained KV-block hashing.

Both functions are on the request path (the router's prefix affinity) and in the
engine simulator, so they are pure, cheap, and stable across processes and machines:
no Python ``hash()`` (randomised per process by ``PYTHONHASHSEED``), only
:mod:`hashlib` over bytes.
"""

from __future__ import annotations

import re
import sys
from array import array
from collections.abc import Sequence
from functools import lru_cache
from hashlib import blake2b

#: Token id range of the fallback tokenizer: 262,144 = Gemma 3's vocabulary size
#: (``vocab_size`` in the model's config.json; see docs/engines.md).
FALLBACK_VOCAB_SIZE = 262_144

#: Maximum letters in one word piece (a leading space joins the piece, as in
#: GPT-2-style byte-level BPE). Calibrated on the Arena-Hard prompts in
#: ``shared/data/prompts``: Gemma 3's tokenizer gives 3.84 (v0.1) and 3.27 (v2.0)
#: characters per token, this fallback with 6 letters 3.67 and 3.50 (4 letters:
#: 3.14 / 3.01; 7: 3.86 / 3.65), so token counts stay within ~7% of a real BPE.
MAX_LETTERS_PER_PIECE = 6

# Pieces: a chat-template control token such as ``<start_of_turn>`` or
# ``<|im_start|>`` (one token in real vocabularies), or an optional leading space,
# then a run of ≤6 letters, ≤3 digits (as
# Llama 3 / GPT-4 pre-tokenisers split numbers), ≤2 other symbols or ≤2
# underscores; whitespace runs are pieces of their own. Every character belongs to
# exactly one piece.
_PIECE = re.compile(
    r"<\|?[a-z_]{2,24}\|?>|"
    rf" ?[^\W\d_]{{1,{MAX_LETTERS_PER_PIECE}}}| ?\d{{1,3}}| ?[^\w\s]{{1,2}}| ?_{{1,2}}|\s+"
)

_HASH_BYTES = 8  # 64-bit block hashes: collision odds ~n²/2⁶⁵, negligible per engine.


@lru_cache(maxsize=1 << 17)
def _piece_id(piece: str) -> int:
    digest = blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=4).digest()
    return int.from_bytes(digest, "little") % FALLBACK_VOCAB_SIZE


#: Longest text :func:`fallback_tokenize` splits with one ``findall`` (a C call that
#: holds the GIL, ~1 ms per 10 k characters; ``finditer`` is ~35% slower per piece).
_FINDALL_CHARS = 65_536


def fallback_tokenize(text: str) -> list[int]:
    """Split ``text`` into BPE-like pieces and map each to a stable token id.

    Used when the served model's tokenizer is not available locally. Pieces follow
    :data:`_PIECE` (≈ 3.5 characters per token on the Arena-Hard prompts,
    within ~7% of Gemma 3's tokenizer); each piece's id is the first 4 bytes of its BLAKE2b digest modulo
    :data:`FALLBACK_VOCAB_SIZE`, so equal text always gives equal ids, in any
    process. Cost: O(len(text)); piece ids are memoised (bounded LRU).

    Args:
        text: the prompt as the engine sees it (chat template already applied).

    Returns:
        Token ids in ``[0, FALLBACK_VOCAB_SIZE)``.
    """
    if len(text) <= _FINDALL_CHARS:
        return [_piece_id(p) for p in _PIECE.findall(text)]
    # one findall over a megabyte prompt is a single C call that holds the GIL for its
    # whole length (~0.5 s for 6 MB), stalling the event loop even from a worker thread;
    # finditer returns to the interpreter, which switches threads, after every piece
    return [_piece_id(m.group()) for m in _PIECE.finditer(text)]


def chain_block_hashes(
    tokens: Sequence[int], block_size: int, salt: str | None = None, *,
    parent: int | None = None,
) -> list[int]:
    """Hash ``tokens`` in full blocks of ``block_size``, each hash chained on the
    previous one, so block ``i``'s hash identifies the whole prefix ``0..i``.

    This is vLLM's prefix-cache key scheme (``hash_block_tokens`` in
    ``vllm/v1/core/kv_cache_utils.py``: hash of (parent hash, block token ids,
    extra keys)); like vLLM's ``generate_block_hash_extra_keys``, ``salt``
    (vLLM's per-request ``cache_salt``) is mixed into the first block only, so
    prompts with different salts share no block while the chain carries the salt
    into every later block. A trailing partial block is not hashed (vLLM caches full
    blocks only). Hash: BLAKE2b-64 over the parent digest, the salt and the block's
    tokens as little-endian int64 bytes.

    Args:
        tokens: token ids of the prompt.
        block_size: tokens per block (vLLM's ``--block-size``; default 16 on GPU,
            128 on the CPU backend), > 0.
        salt: optional isolation key; None or "" means no salt.
        parent: continue a chain instead of starting one: the hash of the block
            just before ``tokens`` (``salt`` is then ignored, the parent carries it).
            ``chain_block_hashes(a + b, n, s)`` equals ``h + chain_block_hashes(b, n,
            parent=h[-1])`` with ``h = chain_block_hashes(a, n, s)`` when ``len(a)``
            is a multiple of ``n``; the KV-event index rebuilds keys this way.

    Returns:
        One unsigned 64-bit int per full block, in order.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    n_full = len(tokens) // block_size
    if n_full == 0:
        return []
    buf = array("q", tokens[: n_full * block_size])
    if sys.byteorder == "big":
        buf.byteswap()
    data = memoryview(buf).cast("B")
    step = block_size * 8
    if parent is not None:
        prev = parent.to_bytes(_HASH_BYTES, "little")
    else:
        prev = b"salt:" + salt.encode("utf-8") + b"\x00" if salt else b""
    hashes: list[int] = []
    for i in range(n_full):
        h = blake2b(prev, digest_size=_HASH_BYTES)
        h.update(data[i * step : (i + 1) * step])
        prev = h.digest()
        hashes.append(int.from_bytes(prev, "little"))
    return hashes
