"""The bundled model's training mix: the kinds of document of ``corpus`` (and RULER's needle tasks,
``ruler_examples``) drawn in set shares from one seeded stream, each sized to the training window."""

from __future__ import annotations

import random
from collections.abc import Callable

from ..errors import RopeExtendError
from .corpus import (
    DRILL_TOKENS,
    DRILLS,
    FILLER_TOKENS,
    FILLERS,
    chronicle,
    copy_drill,
    needle_example,
    passkey_example,
    recall_example,
)
from .ruler_examples import ruler_example


def training_documents(
    seed: int,
    n: int,
    *,
    context: int = 256,
    passkey_share: float = 0.3,
    needle_share: float = 0.05,
    drill_share: float = 0.25,
    recall_share: float = 0.15,
    ruler_share: float = 0.0,
    count: Callable[[str], int] | None = None,
) -> list[str]:
    """``n`` training documents for a ``context``-token window, mixed: passkey examples with filler of every
    kind in ``FILLERS``, associative recall, needle questions, copy drills of every kind in ``DRILLS``
    (without them a model this small never learned to copy), and chronicles (the rest) of up to ``25/16``
    words per token of context (most fill the window; 400 words at 256). Retrieval examples are sized
    from rough tokens-per-sentence figures to end inside the window (the protocol's fixed parts take ~64
    tokens), since the evaluation asks at the full window. ``ruler_share`` of RULER's needle tasks
    (``ruler_examples``; stage 4 of the bundled model), each sized to the window by ``count`` (text -> tokens,
    the tokenizer's), which they need: their template alone takes two thirds of 256 tokens."""
    if ruler_share and count is None:
        raise RopeExtendError("RULER examples need count (text -> tokens) to fit them to the window")
    rng = random.Random(seed)
    max_words = context * 25 // 16
    room = context - 80  # tokens for filler beside the passkey protocol's fixed parts (~74), with a margin
    docs = []
    for _ in range(n):
        kind = rng.random()
        if kind < passkey_share:
            filler = rng.choice(FILLERS)
            most = max(2, room // FILLER_TOKENS[filler])
            docs.append(passkey_example(rng, rng.randint(max(1, most // 3), most), filler=filler))
        elif kind < passkey_share + recall_share:
            facts = rng.randint(2, 6)
            per = FILLER_TOKENS["pseudo"]  # the widest filler; a fact line takes ~14 tokens, a question ~30
            most = max(2, (context - 30 * min(3, facts) - 14 * facts - 8) // per)
            docs.append(recall_example(rng, facts, rng.randint(max(1, most // 3), most)))
        elif kind < passkey_share + recall_share + needle_share:
            docs.append(needle_example(rng, rng.randint(40, max_words // 3)))
        elif kind < passkey_share + recall_share + needle_share + drill_share:
            drill = rng.choice(DRILLS)
            most = max(2, int((context - 24) / (2 * DRILL_TOKENS[drill])))
            fewest = 2 if rng.random() < 0.5 else max(2, most // 3)  # short lists too: copying at every distance
            docs.append(copy_drill(rng, rng.randint(fewest, most), kind=drill))
        elif kind < passkey_share + recall_share + needle_share + drill_share + ruler_share:
            assert count is not None  # checked above
            docs.append(ruler_example(rng, context, count))
        else:
            docs.append(chronicle(rng, rng.randint(60, max_words)))
    return docs
