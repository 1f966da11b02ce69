"""Prompts built in the model's own tokens, to an exact length, with a needle at a requested depth.

The community passkey protocol (Mohtashami & Jaggi 2023, "Landmark Attention"; then YaRN, LongLoRA,
LongRoPE, Self-Extend) joins with newlines: a task line, the filler prefix, the key line, the filler suffix
and the question. Lengths there are token counts of the whole prompt. To hit a length exactly for any
tokenizer, the prompt is assembled in token space: each fixed part is tokenized on its own, and the filler
(or haystack) tokens fill the remaining budget exactly. The needle goes at ``depth`` of the filler, moved to
the nearest sentence boundary (a token ending in ``.``, ``!`` or ``?``), as in the needle-in-a-haystack
test (Kamradt 2023); the start and the end of the filler count as boundaries too (the filler is cut to the
exact budget, so it may end mid-sentence). ``depth = 0`` puts the needle right after the task line,
``depth = 1`` right before the question.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import RopeExtendError

TASK = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"


@dataclass(frozen=True)
class Prompt:
    """A prompt as token ids, with where its needle sits."""

    input_ids: list[int]
    needle_start: int  # index of the needle's first token
    needle_end: int  # one past its last token
    filler_tokens: int  # haystack tokens around the needle
    depth: float  # requested depth
    actual_depth: float  # haystack tokens before the needle / all haystack tokens

    def __len__(self) -> int:
        return len(self.input_ids)


def encode(tokenizer, text: str, *, special: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def sentence_ends(tokenizer, ids: Sequence[int]) -> set[int]:
    """The ids (among ``ids``) whose text ends a sentence."""
    ends = set()
    for i in set(ids):
        text = tokenizer.decode([i]).rstrip()
        if text.endswith((".", "!", "?")):
            ends.add(i)
    return ends


def _boundary(filler: Sequence[int], target: int, ends: set[int]) -> int:
    """The sentence boundary (an index after a sentence-ending token, or 0, or the end) nearest ``target``."""
    bounds = [0] + [i + 1 for i, t in enumerate(filler) if t in ends] + [len(filler)]
    j = bisect.bisect_left(bounds, target)
    near = [bounds[k] for k in (j - 1, j) if 0 <= k < len(bounds)]
    return min(near, key=lambda b: (abs(b - target), b))


def build(
    tokenizer,
    length: int,
    depth: float,
    *,
    head: str,
    needle: str,
    tail: str,
    haystack: Sequence[int],
    ends: set[int] | None = None,
) -> Prompt:
    """``head \\n haystack[:a] \\n needle \\n haystack[a:budget] \\n tail`` in exactly ``length`` tokens.

    ``head`` is tokenized with the tokenizer's special tokens (a BOS if it adds one); the other parts without.
    ``haystack`` is a long enough run of token ids; ``budget = length - fixed parts``.
    """
    if not 0.0 <= depth <= 1.0:
        raise RopeExtendError(f"depth must be in [0, 1], got {depth!r}")
    head_ids = encode(tokenizer, head + "\n", special=True)
    needle_ids = encode(tokenizer, "\n" + needle + "\n")
    tail_ids = encode(tokenizer, "\n" + tail)
    fixed = len(head_ids) + len(needle_ids) + len(tail_ids)
    budget = length - fixed
    if budget < 0:
        raise RopeExtendError(
            f"length {length} is too short: the prompt without any filler already takes {fixed} tokens "
            f"of this tokenizer; use lengths >= {fixed}"
        )
    if len(haystack) < budget:
        raise RopeExtendError(
            f"the haystack text has {len(haystack)} tokens but length {length} needs {budget}: give longer "
            f"texts or shorter lengths (this haystack reaches at most {len(haystack) + fixed} tokens)"
        )
    filler = list(haystack[:budget])
    cut = _boundary(filler, round(depth * budget), ends if ends is not None else sentence_ends(tokenizer, filler))
    ids = head_ids + filler[:cut] + needle_ids + filler[cut:] + tail_ids
    start = len(head_ids) + cut
    return Prompt(ids, start, start + len(needle_ids), budget, depth, cut / budget if budget else depth)


# ------------------------------------------------------------------------------------------ passkey
_FILLER_CACHE: dict[tuple[int, int], list[int]] = {}


def filler_ids(tokenizer, n_tokens: int) -> list[int]:
    """At least ``n_tokens`` tokens of the repeated passkey filler (tokenized as one text, cached)."""
    per = max(1, len(encode(tokenizer, FILLER + " ")))
    repeats = 1
    while repeats * per < n_tokens + 2 * per:  # powers of two, so a sweep of lengths reuses one tokenization
        repeats *= 2
    key = (id(tokenizer), repeats)
    if key not in _FILLER_CACHE:
        if len(_FILLER_CACHE) > 8:
            _FILLER_CACHE.clear()
        _FILLER_CACHE[key] = encode(tokenizer, " ".join([FILLER] * repeats))
    return _FILLER_CACHE[key]


def split_sentences(text: str | Sequence[str]) -> list[str]:
    """A text's sentences (split after ``.``, ``!`` or ``?`` and whitespace), or a list of sentences as given."""
    sentences = re.split(r"(?<=[.!?])\s+", text.strip()) if isinstance(text, str) else [str(s).strip() for s in text]
    sentences = [s for s in sentences if s]
    if not sentences:
        raise RopeExtendError("filler: got no sentences; give a text or a non-empty list of sentences")
    return sentences


def text_filler_ids(tokenizer, sentences: Sequence[str], start: int, n_tokens: int) -> list[int]:
    """At least ``n_tokens`` tokens of ``sentences`` joined by spaces, from sentence ``start`` on, wrapping
    around to the first after the last."""
    ids: list[int] = []
    i = start
    while len(ids) < n_tokens + 16:
        chunk = " ".join(sentences[(i + j) % len(sentences)] for j in range(8))
        ids += encode(tokenizer, (" " if ids else "") + chunk)
        i += 8
    return ids


def passkey_prompt(
    tokenizer, length: int, key: int, depth: float, *, filler: Sequence[str] | None = None, start: int = 0
) -> Prompt:
    """The passkey prompt for ``key`` at ``depth``, exactly ``length`` tokens of ``tokenizer``.

    ``filler``: sentences to use as the haystack instead of the protocol's repeated ``FILLER``, read from
    sentence ``start`` on (wrapping around): a test that retrieval does not depend on knowing the filler."""
    haystack = filler_ids(tokenizer, length) if filler is None else text_filler_ids(tokenizer, filler, start, length)
    return build(
        tokenizer,
        length,
        depth,
        head=TASK,
        needle=KEY_LINE.format(key=key),
        tail=QUESTION,
        haystack=haystack,
        ends=sentence_ends(tokenizer, haystack[: min(len(haystack), 4096)]),
    )


def haystack_ids(tokenizer, texts: Sequence[str], n_tokens: int) -> list[int]:
    """Tokens of ``texts`` joined by blank lines, stopping once ``n_tokens`` are reached (for a needle test)."""
    ids: list[int] = []
    sep = encode(tokenizer, "\n\n")
    for text in texts:
        ids += (sep if ids else []) + encode(tokenizer, text)
        if len(ids) >= n_tokens:
            break
    return ids
