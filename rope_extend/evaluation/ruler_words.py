"""RULER's word lists, read from the ``wonderwords`` package as RULER reads them.

RULER (NVIDIA/RULER ``scripts/data/synthetic/niah.py`` and ``common_words_extraction.py``) takes its words from
wonderwords' bundled noun, adjective and verb lists, each line stripped:

- a needle's word key is one of the distinct ``adjective-noun`` strings (6,171,620 with wonderwords 3.0), drawn
  uniformly. The strings are not materialised here: an adjective and a noun are drawn uniformly and the pair is
  kept with probability ``1 / m``, where ``m`` is the number of ways the string splits into an adjective, a
  hyphen and a noun (``m > 1`` only for hyphenated words, e.g. ``sea`` + ``side-walk`` and ``sea-side`` +
  ``walk``), so every distinct string is equally likely, as RULER's ``random.choice`` over the sorted set;
- common words extraction draws from the distinct nouns, adjectives and verbs (8,166 words), put in a fixed
  order. RULER then switches to a larger English list (``english_words.json``) for a list longer than that;
  rope-extend does not ship it, so such a length is refused (see ``ruler.cwe``), never filled with made-up
  words.

The lists differ between wonderwords releases (3.0 changed the nouns), so their digest joins every RULER
record's setting: records made with other lists are measured again.
"""

from __future__ import annotations

import hashlib
import random
from functools import cache
from importlib import resources

from ..errors import RopeExtendError


def _read(name: str) -> tuple[str, ...]:
    try:
        text = resources.files("wonderwords.assets").joinpath(name).read_text(encoding="utf-8")
    except ModuleNotFoundError as e:  # a main dependency; a broken install says so plainly
        raise RopeExtendError(
            "RULER's word lists come from the wonderwords package, which is not installed: pip install wonderwords"
        ) from e
    return tuple(w for w in (line.strip() for line in text.splitlines()) if w)


@cache
def nouns() -> tuple[str, ...]:
    return tuple(sorted(set(_read("nounlist.txt"))))


@cache
def adjectives() -> tuple[str, ...]:
    return tuple(sorted(set(_read("adjectivelist.txt"))))


@cache
def verbs() -> tuple[str, ...]:
    return tuple(sorted(set(_read("verblist.txt"))))


@cache
def _sets() -> tuple[frozenset[str], frozenset[str]]:
    return frozenset(adjectives()), frozenset(nouns())


def splits(key: str) -> int:
    """In how many ways ``key`` is ``adjective-noun``: the number of (adjective, noun) pairs that give it."""
    adj, noun = _sets()
    return sum(key[:i] in adj and key[i + 1 :] in noun for i, c in enumerate(key) if c == "-")


def draw_key(rng: random.Random) -> str:
    """A distinct ``adjective-noun`` string, uniformly (see the module docstring)."""
    adj, noun = adjectives(), nouns()
    while True:
        key = f"{rng.choice(adj)}-{rng.choice(noun)}"
        # one hyphen: one split; else keep with probability 1/m
        if key.count("-") == 1 or rng.random() * splits(key) < 1:
            return key


@cache
def common_words() -> tuple[str, ...]:
    """The distinct nouns, adjectives and verbs, in a fixed shuffled order (cwe's source)."""
    words = sorted(set(nouns()) | set(adjectives()) | set(verbs()))
    random.Random("ruler-cwe-words").shuffle(words)
    return tuple(words)


@cache
def digest() -> str:
    """Of the three lists, as read: records made with other word lists are not reused."""
    h = hashlib.sha256()
    for words in (nouns(), adjectives(), verbs()):
        h.update("\n".join(words).encode() + b"\0")
    return h.hexdigest()[:16]
