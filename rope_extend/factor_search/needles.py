"""The search's documents: the texts themselves (``fitness="text"``) or needle documents (``fitness="needle"``).

LongRoPE2 (Shang et al. 2025, "LongRoPE2: Near-Lossless LLM Context Window Scaling", section 3.2) judges a
candidate by "needle-driven" perplexity: needles are placed at several depths of long documents, and the
perplexity is taken over the answer tokens only, so that a candidate wins by finding what lies far back, not by
reading the text around it better. Here each needle document is one of the evaluation harnesses' own prompts,
built from the search texts to the target length, followed by its answer:

- passkey (``evaluation.prompts.passkey_prompt``, the search texts' sentences as the haystack) at the depths
  ``PASSKEY_DEPTHS``, the answer `` KEY``;
- RULER's key-value needle ``niah_single_2`` (``evaluation.ruler.sizing.build_prompt``: a 7-digit value for a
  word key in the search texts' words, at a depth RULER draws), the answer `` VALUE``, in RULER's ``base``
  format (the text as is: the fitness reads documents, not a chat).

``fitness="needle-multiquery"`` packs the needles into one document an evaluation, a sixth of ``needle``'s cost
(one forward pass of ``s L`` tokens is most of an evaluation's time): RULER's ``niah_multiquery`` form (its needle
sentence, word keys and 7-digit values, its question and answer prefix, in the ``base`` format) with five needles,
one at each of the fixed depths ``MULTIQUERY_DEPTHS`` rather than at drawn ones (four drawn depths can all fall in
the second half, where the distance to the question is inside the trained length), all five asked for in one
question in a shuffled order; the answer is the five values in that order, `` V1, V2, V3, V4, V5``. A passkey has
no key to ask it by among others, so this document holds RULER's needles only.

A document is ``(token ids, first scored index)``: the text fitness scores every token after the first, the
needle fitness only the answer's tokens at the end. Keys and depths come from ``seed``, so a resumed search
rebuilds the same documents (their digest is part of the saved settings).
"""

from __future__ import annotations

import random

from ..errors import RopeExtendError
from ..evaluation import ruler_words
from ..evaluation.prompts import encode, passkey_prompt, split_sentences
from ..evaluation.ruler.sizing import Haystack, PromptFormat, build_prompt, largest_fitting
from ..evaluation.ruler.subtasks import NEEDLE, Draft, niah_question
from .choices import FITNESSES

PASSKEY_DEPTHS = (0.1, 0.5, 0.9)
RULER_TASK = "niah_single_2"
RULER_NEEDLES = 3
ANSWER_TOKENS = 16  # room left for a RULER answer (7 digits and a space take at most 8 tokens of any tokenizer)
MULTIQUERY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # one needle at each, in a single document


def check_fitness(fitness) -> str:
    if fitness not in FITNESSES:
        raise RopeExtendError(f"fitness must be one of {', '.join(FITNESSES)}, got {fitness!r}")
    return fitness


def _texts(texts) -> list[str]:
    texts = [t for t in texts if isinstance(t, str) and t.strip()]
    if not texts:
        raise RopeExtendError("the search needs texts: give at least one non-empty document")
    return texts


def text_documents(tokenizer, texts, length: int) -> list[tuple[list[int], int]]:
    """The first ``length`` tokens of each text at least that long, every token after the first scored."""
    texts = _texts(texts)
    docs = [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
    kept = [(d[:length], 1) for d in docs if len(d) >= length]
    if not kept:
        raise RopeExtendError(
            f"no text reaches the target length {length} tokens (the longest has {max(map(len, docs))}); give "
            "longer texts or a smaller factor"
        )
    return kept


def needle_documents(tokenizer, texts, length: int, seed: int) -> list[tuple[list[int], int]]:
    """Passkey documents at ``PASSKEY_DEPTHS`` and ``RULER_NEEDLES`` RULER key-value documents, each at most
    ``length`` tokens with its answer last; only the answer is scored."""
    texts = _texts(texts)
    sentences = split_sentences(" ".join(texts))
    rng = random.Random(f"needle:{seed}")
    docs = []
    try:
        for depth in PASSKEY_DEPTHS:
            key = rng.randint(1, 50000)  # the passkey protocol's range
            answer = encode(tokenizer, f" {key}")
            prompt = passkey_prompt(
                tokenizer, length - len(answer), key, depth, filler=sentences, start=rng.randrange(len(sentences))
            )
            docs.append((prompt.input_ids + answer, len(prompt)))
        haystack = Haystack(texts)
        for sample in range(RULER_NEEDLES):
            ruler = build_prompt(
                tokenizer, RULER_TASK, length, seed=seed, sample=sample, haystack=haystack, chat_template=False,
                max_new_tokens=ANSWER_TOKENS,
            )  # fmt: skip
            answer = encode(tokenizer, " " + ruler.answers[0])
            if len(answer) > ANSWER_TOKENS:
                raise RopeExtendError(f"the RULER answer {ruler.answers[0]!r} takes {len(answer)} tokens")
            docs.append((ruler.input_ids + answer, len(ruler)))
    except RopeExtendError as exc:
        raise RopeExtendError(f"the needle fitness at {length} tokens: {exc}") from None
    return docs


def _multiquery_draft(rng: random.Random, sentences: list[str]) -> Draft:
    """RULER's multi-query needle prompt over ``sentences``, with one needle at each of ``MULTIQUERY_DEPTHS``."""
    keys: list[str] = []
    while len(keys) < len(MULTIQUERY_DEPTHS):
        key = ruler_words.draw_key(rng)
        if key not in keys:
            keys.append(key)
    values = {k: str(rng.randint(10**6, 10**7 - 1)) for k in keys}  # RULER's 7-digit values
    parts, last = [], 0
    for depth, key in zip(MULTIQUERY_DEPTHS, keys, strict=True):
        cut = int(len(sentences) * depth)
        parts += [*sentences[last:cut], NEEDLE.format(kind="numbers", key=key, value=values[key])]
        last = cut
    context = " ".join(parts + sentences[last:])
    asked = rng.sample(keys, len(keys))  # asked in another order than placed, as RULER asks
    return niah_question(context, "numbers", asked, [values[k] for k in asked])


def multiquery_documents(tokenizer, texts, length: int, seed: int) -> list[tuple[list[int], int]]:
    """One document of at most ``length`` tokens in RULER's ``niah_multiquery`` form: a key-value needle at each
    of ``MULTIQUERY_DEPTHS`` of the texts' sentences, all asked for in one question, the values last (joined by
    ``", "``, in the order asked); only they are scored. The haystack is the most sentences that fit."""
    sentences = split_sentences(" ".join(_texts(texts)))
    fmt = PromptFormat(tokenizer, chat=False)

    def draft(n: int) -> Draft:
        return _multiquery_draft(random.Random(f"needle-multiquery:{seed}"), sentences[:n])

    def tokens(n: int) -> int:
        d = draft(n)
        return len(fmt.ids(d)) + len(encode(tokenizer, " " + ", ".join(d.answers)))

    fewest = 2 * len(MULTIQUERY_DEPTHS)  # sentences, so that the needles' depths stay apart
    if len(sentences) < fewest:
        raise RopeExtendError(
            f"the needle-multiquery fitness: the texts have {len(sentences)} sentences, it needs at least {fewest} "
            "around its needles; give longer texts"
        )
    n = largest_fitting(tokens, length, len(MULTIQUERY_DEPTHS), len(sentences))
    if n is None or n < fewest:
        raise RopeExtendError(
            f"the needle-multiquery fitness: length {length} is too short for its question and needles"
        )
    if n == len(sentences) and tokens(n) < 0.9 * length:
        raise RopeExtendError(
            f"the needle-multiquery fitness: the texts ({len(sentences)} sentences, {tokens(n)} tokens with the "
            f"needles) cannot fill {length} tokens; give longer texts or a smaller factor"
        )
    d = draft(n)
    prompt = fmt.ids(d)
    return [(prompt + encode(tokenizer, " " + ", ".join(d.answers)), len(prompt))]


def documents(tokenizer, texts, length: int, *, fitness: str, seed: int) -> list[tuple[list[int], int]]:
    """The search's documents for ``fitness`` (see the module docstring)."""
    kind = check_fitness(fitness)
    if kind == "text":
        return text_documents(tokenizer, texts, length)
    if kind == "needle-multiquery":
        return multiquery_documents(tokenizer, texts, length, seed)
    return needle_documents(tokenizer, texts, length, seed)
