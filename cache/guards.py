"""Lexical guards for the semantic cache: cases where sentence embeddings are known to
rate two different questions as near-identical.

Embedding models score "how do I enable X" and "how do I disable X", or "a loan for
5 years" and "a loan for 15 years", at cosine 0.9+ (negation and numbers barely move
mean-pooled embeddings; see Ettinger 2020, "What BERT is not", and the GPTCache issue
tracker for the same failure in production caches). A semantic hit therefore also
needs :func:`compatible` to hold between the stored and the incoming question:

* **negation** — both or neither contain a negation word (``not``, ``n't``, ``no``,
  ``never``, ``without`` …);
* **opposites** — one must not contain a word whose antonym (from
  :data:`ANTONYMS`, compared after a crude suffix stem) the other contains while
  lacking the word itself;
* **numbers** — the multisets of numbers (digits, and number words one–twenty,
  hundred, thousand, million, billion) are equal;
* **named entities** — every capitalised token that does not start a sentence and
  is not a function word (a cheap proper-noun detector) in either text appears,
  case-insensitively and after the same stem, as a token of the other
  ("Olympics" ~ "olympic").

All checks are pure functions over precomputed :class:`Features`, ~10 µs per pair.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"[A-Za-z][A-Za-z'’]*|\d+(?:[.,]\d+)*")
_SENTENCE_END = re.compile(r"[.?!:;\n]")

NEGATIONS: frozenset[str] = frozenset({
    "not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "nowhere",
    "without", "cannot", "unable",
})

#: Opposite pairs (both directions are checked). Extend with care: a false opposite
#: only costs recall, a missing one can cost precision.
ANTONYMS: tuple[tuple[str, str], ...] = (
    ("enable", "disable"), ("increase", "decrease"), ("add", "remove"),
    ("start", "stop"), ("open", "close"), ("allow", "deny"), ("allow", "block"),
    ("buy", "sell"), ("true", "false"), ("before", "after"), ("min", "max"),
    ("minimum", "maximum"), ("encrypt", "decrypt"), ("upload", "download"),
    ("import", "export"), ("install", "uninstall"), ("lock", "unlock"),
    ("include", "exclude"), ("accept", "reject"), ("win", "lose"), ("good", "bad"),
    ("best", "worst"), ("advantage", "disadvantage"), ("pro", "con"), ("love", "hate"),
    ("male", "female"), ("man", "woman"), ("men", "women"), ("boy", "girl"),
    ("first", "last"), ("more", "less"), ("higher", "lower"), ("high", "low"),
    ("hot", "cold"), ("fast", "slow"), ("cheap", "expensive"), ("positive", "negative"),
    ("rich", "poor"), ("old", "new"), ("old", "young"), ("largest", "smallest"),
    ("biggest", "smallest"), ("big", "small"), ("large", "small"), ("long", "short"),
    ("up", "down"), ("on", "off"), ("in", "out"), ("push", "pull"), ("legal", "illegal"),
    ("safe", "dangerous"), ("easy", "hard"), ("easy", "difficult"), ("success", "failure"),
    ("connect", "disconnect"), ("subscribe", "unsubscribe"), ("follow", "unfollow"),
    ("block", "unblock"), ("like", "dislike"), ("agree", "disagree"), ("win", "loss"),
    ("input", "output"), ("send", "receive"), ("mount", "unmount"),
    ("compress", "decompress"), ("encode", "decode"), ("ascending", "descending"),
    ("north", "south"), ("east", "west"), ("left", "right"), ("top", "bottom"),
    ("light", "dark"), ("day", "night"), ("past", "future"), ("always", "never"),
    ("shortest", "longest"), ("he", "she"), ("his", "her"), ("him", "her"),
    ("guy", "girl"), ("husband", "wife"), ("boyfriend", "girlfriend"),
    ("father", "mother"), ("son", "daughter"), ("brother", "sister"),
)

#: "one" is left out: it is mostly a pronoun ("how can one learn …"); "1" still counts.
_NUMBER_WORDS = {
    w: str(i) for i, w in enumerate((
        "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
        "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
        "eighteen", "nineteen", "twenty")) if w != "one"
} | {"hundred": "100", "thousand": "1000", "million": "1000000", "billion": "1000000000"}

#: Capitalised mid-sentence by habit or typo, never a name on their own.
_FUNCTION_WORDS: frozenset[str] = frozenset((
    "i", "a", "an", "the", "and", "or", "but", "if", "is", "are", "was", "were", "be", "do",
    "does", "did", "how", "what", "why", "when", "where", "who", "which", "whom", "whose",
    "can", "could", "should", "would", "will", "shall", "may", "might", "must", "to", "of",
    "in", "on", "at", "for", "from", "by", "with", "about", "as", "into", "than", "then", "so",
    "it", "its", "this", "that", "these", "those", "my", "your", "his", "her", "our", "their",
    "me", "you", "he", "she", "we", "they",
))


def _stem(word: str) -> str:
    """Crude suffix stripping so inflections compare equal (enabled → enabl ← enable)."""
    for suffix in ("ing", "ed", "es", "s", "e"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return word[: -len(suffix)]
    return word


_OPPOSITE: dict[str, frozenset[str]] = {}
for _a, _b in ANTONYMS:
    for _x, _y in ((_stem(_a), _stem(_b)), (_stem(_b), _stem(_a))):
        _OPPOSITE[_x] = _OPPOSITE.get(_x, frozenset()) | {_y}


@dataclass(frozen=True)
class Features:
    """What the guards compare, extracted once per text by :func:`features`.

    Attributes:
        tokens: stems of the lower-cased word tokens.
        negated: whether a negation word (or ``n't``) occurs.
        polar: stems of words that have an antonym in :data:`ANTONYMS`.
        numbers: sorted numbers as normalised strings (``1,000`` → ``1000``).
        entities: stems of capitalised tokens not at a sentence start (function
            words excluded).
    """

    tokens: frozenset[str]
    negated: bool
    polar: frozenset[str]
    numbers: tuple[str, ...]
    entities: frozenset[str]


def features(text: str) -> Features:
    """Extract :class:`Features` from one question."""
    tokens: list[str] = []
    entities: set[str] = set()
    numbers: list[str] = []
    negated = False
    sentence_start = True
    pos = 0
    for m in _TOKEN.finditer(text):
        if _SENTENCE_END.search(text, pos, m.start()):
            sentence_start = True
        pos = m.end()
        raw = m.group(0).replace("’", "'")
        if raw[0].isdigit():
            numbers.append(raw.replace(",", ""))
            sentence_start = False
            continue
        low = raw.lower()
        if low.endswith("n't"):
            negated = True
            low = low[:-3]
        elif low.endswith("'s") or low.endswith("'re") or low.endswith("'ve"):
            low = low.split("'")[0]
        if low in NEGATIONS:
            negated = True
        if low in _NUMBER_WORDS:
            numbers.append(_NUMBER_WORDS[low])
        if raw[0].isupper() and not sentence_start and low not in _FUNCTION_WORDS:
            entities.add(_stem(low))
        tokens.append(low)
        sentence_start = False
    stems = frozenset(map(_stem, tokens))
    polar = frozenset(s for s in stems if s in _OPPOSITE)
    return Features(stems, negated, polar, tuple(sorted(numbers)),
                    frozenset(entities))


def compatible(a: Features, b: Features) -> bool:
    """True when no guard separates the two questions (see the module docstring)."""
    if a.negated != b.negated or a.numbers != b.numbers:
        return False
    if not (a.entities <= b.tokens and b.entities <= a.tokens):
        return False
    only_a, only_b = a.polar - b.polar, b.polar - a.polar
    return not any(_OPPOSITE[w] & only_b for w in only_a)
