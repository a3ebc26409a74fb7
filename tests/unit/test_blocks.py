"""engines/blocks.py: stable fallback tokenisation and chained block hashes."""

from __future__ import annotations

import os
import subprocess
import sys

from engines.blocks import FALLBACK_VOCAB_SIZE, chain_block_hashes, fallback_tokenize

TEXT = "The quick brown fox jumps over the lazy dog, 12345 times_over! Ünïcode too.\n"


def test_tokenize_deterministic_and_in_range():
    ids = fallback_tokenize(TEXT)
    assert ids == fallback_tokenize(TEXT)
    assert all(0 <= t < FALLBACK_VOCAB_SIZE for t in ids)
    # BPE-like density: roughly 3-5 characters per token on prose.
    assert 2.5 < len(TEXT) / len(ids) < 5.5


def test_tokenize_covers_every_character():
    from engines.blocks import _PIECE

    assert "".join(_PIECE.findall(TEXT)) == TEXT


def test_tokenize_prefix_property():
    # Equal text prefixes (ending at a word boundary) give equal token prefixes.
    a = fallback_tokenize("shared system prompt here. user one asks")
    b = fallback_tokenize("shared system prompt here. user two asks")
    assert a[:6] == b[:6]


def test_stable_across_processes():
    code = (
        "from engines.blocks import fallback_tokenize, chain_block_hashes;"
        f"t = fallback_tokenize({TEXT!r} * 10); print(chain_block_hashes(t, 4, 'x'))"
    )
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                capture_output=True, text=True).stdout)
    assert len(outs) == 1
    toks = fallback_tokenize(TEXT * 10)
    assert outs.pop().strip() == str(chain_block_hashes(toks, 4, "x"))


def test_full_blocks_only_and_chaining():
    toks = list(range(100))
    h = chain_block_hashes(toks, 16)
    assert len(h) == 6  # 96 tokens in full blocks; the partial 4 are not hashed
    assert chain_block_hashes(toks[:15], 16) == []
    # Same block content after a different prefix gives a different hash (chained).
    other = [999] * 16 + toks[16:]
    h2 = chain_block_hashes(other, 16)
    assert h2[0] != h[0] and all(x != y for x, y in zip(h, h2, strict=False))
    # A shared prefix gives shared leading hashes, then divergence.
    div = toks[:40] + [7] * 60
    h3 = chain_block_hashes(div, 16)
    assert h3[:2] == h[:2] and h3[2] != h[2]


def test_salt_isolates_every_block():
    toks = list(range(64))
    plain, a, b = (chain_block_hashes(toks, 16, s) for s in (None, "tenant-a", "tenant-b"))
    assert chain_block_hashes(toks, 16, "") == plain
    assert not set(plain) & set(a) and not set(a) & set(b)
    assert a == chain_block_hashes(toks, 16, "tenant-a")


def test_bad_block_size():
    import pytest

    with pytest.raises(ValueError):
        chain_block_hashes([1, 2], 0)
