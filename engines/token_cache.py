"""Reuse the token ids of chat turns the gateway has already tokenized.

A conversation's request carries every earlier turn again; tokenizing the whole
rendered prompt costs ~3–5 µs per token with a model's ``tokenizers`` tokenizer (a
12k-token Mooncake conversation: ~40–60 ms of gateway CPU per request), most of it on
text seen one turn earlier. :class:`TurnTokenCache` cuts the rendered prompt before
each turn marker of the chat template (Gemma's ``<start_of_turn>``, ChatML's
``<|im_start|>`` …: special tokens, which the tokenizer matches before
pre-tokenization, so no token spans a cut) and tokenizes only the segments it has
not seen, keyed by a BLAKE2b-128 digest of the segment's text, in a bounded LRU.

Splitting is exact only if the tokenizer maps the concatenation to the concatenated
ids; :meth:`TurnTokenCache.verify` checks that on a sample (a tokenizer that, say,
prepends a space to every input would fail it) and the encoder then leaves the cache
off.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from hashlib import blake2b

#: Default bound: 4M cached token ids ≈ 16 MB (``array('I')``, 4 bytes each, plus
#: ~150 B per segment for the key and the LRU node).
DEFAULT_MAX_TOKENS = 4_000_000


def turn_markers(template: str, special_tokens: Iterable[str]) -> re.Pattern[str] | None:
    """A pattern of the special tokens the chat template writes at the start of a
    turn: those of ``special_tokens`` that appear in ``template`` and contain
    ``start`` (``<start_of_turn>``, ``<|im_start|>``, ``<|start_header_id|>``); None
    if there is none."""
    found = sorted({t for t in special_tokens if t and t in template and "start" in t},
                   key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in found)) if found else None


def split_turns(text: str, markers: re.Pattern[str]) -> list[str]:
    """``text`` cut before every ``markers`` match (the first segment keeps any
    prefix such as ``<bos>``); ``"".join`` of the result is ``text``."""
    cuts = [m.start() for m in markers.finditer(text) if m.start() > 0]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


class TurnTokenCache:
    """Token ids per segment text, LRU, at most ``max_tokens`` ids in all.

    Thread-safe (encoders run in worker threads). Counters ``hits``, ``misses``
    (segments) and ``tokens`` (ids held).

    Args:
        markers: turn markers (:func:`turn_markers`).
        encode: the tokenizer: text → ids, no special tokens added.
        max_tokens: bound on the ids held.
    """

    def __init__(self, markers: re.Pattern[str], encode: Callable[[str], list[int]],
                 max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.markers = markers
        self._encode = encode
        self.max_tokens = max_tokens
        self._lru: OrderedDict[bytes, array] = OrderedDict()
        self._lock = threading.Lock()
        self.tokens = self.hits = self.misses = 0

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: cached segments reused, the others tokenized and
        cached."""
        out: list[int] = []
        for seg in split_turns(text, self.markers):
            key = blake2b(seg.encode("utf-8", "surrogatepass"), digest_size=16).digest()
            with self._lock:
                ids = self._lru.get(key)
                if ids is not None:
                    self._lru.move_to_end(key)
                    self.hits += 1
            if ids is None:
                ids = array("I", self._encode(seg))
                self._put(key, ids)
            out.extend(ids)
        return out

    def _put(self, key: bytes, ids: array) -> None:
        with self._lock:
            self.misses += 1
            if len(ids) > self.max_tokens or key in self._lru:
                return
            self._lru[key] = ids
            self.tokens += len(ids)
            while self.tokens > self.max_tokens:
                _, old = self._lru.popitem(last=False)
                self.tokens -= len(old)

    def verify(self, sample: str) -> bool:
        """True if tokenizing ``sample`` by segments gives the same ids as whole
        (the condition for this cache to be exact); nothing is cached."""
        parts: list[int] = []
        for seg in split_turns(sample, self.markers):
            parts.extend(self._encode(seg))
        return parts == list(self._encode(sample))
