"""Turn-by-turn tokenization with reuse: exact against the whole-prompt tokenization
(Gemma 3's real tokenizer, when prepared), earlier turns not tokenized again, the
bound, and the verification that keeps the cache off for a tokenizer it would break."""

from __future__ import annotations

import re

import pytest

from engines.prompt import HFEncoder, local_model_folder
from engines.token_cache import TurnTokenCache, split_turns, turn_markers
from loadtest.workloads.base import synthetic_text
from tests.unit.test_prefix_blocks import engines_cfg

MARK = re.compile(re.escape("<start_of_turn>"))


def test_split_turns_cuts_before_markers_only():
    text = "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    parts = split_turns(text, MARK)
    assert parts == ["<bos>", "<start_of_turn>user\nhi<end_of_turn>\n", "<start_of_turn>model\n"]
    assert "".join(parts) == text
    assert split_turns("no markers", MARK) == ["no markers"]


def test_turn_markers_from_template():
    tpl = "{{ '<start_of_turn>' + role }}...{{ '<end_of_turn>' }}"
    assert turn_markers(tpl, ["<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"]) \
        .pattern == re.escape("<start_of_turn>")
    assert turn_markers("{{ messages }}", ["<start_of_turn>"]) is None


def test_reuse_bound_and_verify_with_a_counting_tokenizer():
    calls: list[str] = []

    def encode(s: str) -> list[int]:  # one id per character: concatenation-exact
        calls.append(s)
        return [ord(c) for c in s]

    cache = TurnTokenCache(MARK, encode, max_tokens=60)
    t1 = "<bos><start_of_turn>user\nabc<end_of_turn>\n"
    t2 = t1 + "<start_of_turn>model\nxyz<end_of_turn>\n"
    assert cache.encode(t1) == [ord(c) for c in t1]
    calls.clear()
    assert cache.encode(t2) == [ord(c) for c in t2]
    assert calls == ["<start_of_turn>model\nxyz<end_of_turn>\n"]  # only the new turn
    assert cache.hits == 2 and cache.misses == 3
    assert cache.tokens <= 60  # the oldest segments went
    assert cache.verify(t2)
    prepend = TurnTokenCache(MARK, lambda s: [0] + [ord(c) for c in s])
    assert not prepend.verify(t2)  # e.g. a tokenizer that prepends to every input


@pytest.mark.skipif(local_model_folder(engines_cfg("vllm").engines[0]) is None,
                    reason="prepared gemma3-270m model not present")
def test_gemma_conversation_is_tokenized_once_per_turn():
    enc = HFEncoder(local_model_folder(engines_cfg("vllm").engines[0]))
    enc._load()
    assert enc.turns is not None  # Gemma's tokenizer passes verification
    whole = enc._tokenizer
    messages = [{"role": "system", "content": "Be brief.  "}]
    new_segments = []
    for turn in range(5):
        messages.append({"role": "user", "content": synthetic_text(f"u{turn}", 400) + " \n"})
        before = enc.turns.misses
        ids = enc.encode_chat(messages)
        new_segments.append(enc.turns.misses - before)
        text = enc.render_chat(messages)
        assert ids == whole.encode(text, add_special_tokens=False).ids
        messages.append({"role": "assistant", "content": " ok, " + synthetic_text(f"a{turn}", 50)})
    # first request: <bos>, the user turn, the generation prompt; then each request
    # tokenizes only the previous answer and the new question
    assert new_segments == [3, 2, 2, 2, 2]
