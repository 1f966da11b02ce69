"""RULER's needle tasks as training text for the bundled model, so that its card can show a RULER score.

A RULER niah sample is a long instruction ("Some special magic numbers are hidden within the following text.
..."), a haystack with one or more needles ("One of the special magic numbers for colorful-preparation is:
2058756."), a question and an answer prefix; the model has to continue the prefix with the values asked for.
The testbed retrieves pass keys, but it had never seen these words: it answered nothing, and RULER scored 0 at
every length (issue 69). These examples are the harness's own samples (``evaluation.ruler.subtasks.niah_draft``,
RULER's templates in the base format, the tokenizer's special tokens only), drawn from a training seed, with the
answer written after the prefix as a model would say it (``" 2058756."``, several values joined by ", "). The
essay haystack is chronicle text of the training stream (the evaluation's comes from the held-out chronicles).

Only what fits the 256-token window is taught: the template alone takes about 170 of its tokens, so the
haystack holds a few noise or needle lines, or up to ~80 essay words. Longer haystacks are what extension
methods are then measured on, as passkeys are taught at 256 and asked at 1024.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from ..errors import RopeExtendError
from ..evaluation.ruler.subtasks import NIAH, niah_draft
from .corpus import chronicle

# the niah tasks taught: every one whose smallest sample fits 256 tokens with its answer (niah_multikey_1,
# niah_multikey_3, niah_multivalue and niah_multiquery do not; RULER's card leaves them out at L = 256 too)
TAUGHT = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_2")
ATTEMPTS = 8  # draws per example before a smaller haystack is tried


def answer_text(answers: list[str]) -> str:
    """The continuation of the answer prefix: ``" 2058756."`` or ``" 11, 22, 33."``."""
    return " " + ", ".join(answers) + "."


def ruler_example(rng: random.Random, context: int, count: Callable[[str], int]) -> str:
    """One RULER niah sample with its answer, of at most ``context`` tokens as ``count`` measures them: a task
    drawn from ``TAUGHT``, a haystack size drawn uniformly up to the largest that fits (found by halving)."""
    task = rng.choice(TAUGHT)
    essay = NIAH[task].haystack == "essay"
    words = chronicle(rng, 200).split(" ") if essay else []
    most = len(words) if essay else 8
    while most >= 1:
        for _ in range(ATTEMPTS):
            n = rng.randint(1, most)
            draft = niah_draft(task, rng, n, words)
            text = draft.user + draft.prefix + answer_text(draft.answers)
            if count(text) <= context:
                return text
        most //= 2
    raise RopeExtendError(f"a {context}-token window holds no RULER {task} sample with its answer; use >= 256")
