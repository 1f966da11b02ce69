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

A document is ``(token ids, first scored index)``: the text fitness scores every token after the first, the
needle fitness only the answer's tokens at the end. Keys and depths come from ``seed``, so a resumed search
rebuilds the same documents (their digest is part of the saved settings).
"""

from __future__ import annotations

import random

from ..errors import RopeExtendError
from ..evaluation.prompts import encode, passkey_prompt, split_sentences
from ..evaluation.ruler.sizing import Haystack, build_prompt
from .choices import FITNESSES

PASSKEY_DEPTHS = (0.1, 0.5, 0.9)
RULER_TASK = "niah_single_2"
RULER_NEEDLES = 3
ANSWER_TOKENS = 16  # room left for a RULER answer (7 digits and a space take at most 8 tokens of any tokenizer)


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


def documents(tokenizer, texts, length: int, *, fitness: str, seed: int) -> list[tuple[list[int], int]]:
    """The search's documents for ``fitness`` (see the module docstring)."""
    if check_fitness(fitness) == "text":
        return text_documents(tokenizer, texts, length)
    return needle_documents(tokenizer, texts, length, seed)
