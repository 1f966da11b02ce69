"""Needle in a haystack (Kamradt 2023): a user-given needle sentence placed at a depth (on a sentence
boundary) in a haystack of real text, over a length x depth grid; scored by substring match (the answer,
case-insensitive, appears in the greedy output), not by an LLM judge. The deliverable is the heatmap.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import RopeExtendError
from .passkey import trial_rng
from .prompts import Prompt, build, haystack_ids, sentence_ends
from .records import short_hash
from .retrieval import RetrievalResult, run_grid
from .tasks.base import options_for
from .tasks.options import NiahOptions

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco? Answer: The best thing to do in San Francisco is"
ANSWER = "Dolores Park"
HEAD = "Read the document below and answer the question at the end."
DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]


def score(output: str, answer: str) -> tuple[str, bool]:
    """Substring match, case-insensitive, whitespace-normalised."""

    def norm(s: str) -> str:
        return " ".join(s.lower().split())

    return output.strip(), norm(answer) in norm(output)


def niah(
    model,
    tokenizer,
    haystack: Sequence[str],
    lengths: str | Iterable[Any] | None = None,
    *,
    options: NiahOptions | None = None,
    records: str | os.PathLike | None = None,
    resume: bool = False,
    progress: bool = True,
    run: dict[str, Any] | None = None,
    **given: Any,
) -> RetrievalResult:
    """Needle retrieval accuracy over ``lengths`` x ``depths`` (default 0, 25, 50, 75, 100%).

    The options are ``NiahOptions``'s (the task's, declared once), given as keywords or as ``options=``; of
    its text options only ``max_docs`` (the haystack is given). ``haystack`` is a list of texts (see
    ``data.load_texts``), joined by blank lines; it must reach the longest length. With ``trials > 1`` each
    trial starts the haystack at a different (seeded) document; ``trials_at`` (``{"16k": 3}``) sets other
    counts at particular lengths. ``needle``, ``question`` and ``answer`` left None are the San Francisco
    needle's. ``records``/``resume``/``progress``/``run`` are the evaluation runner's.
    """
    if lengths is not None:
        given["lengths"] = lengths
    options = options_for(NiahOptions, options, given, harness="niah")
    seed = options.seed
    grid = options.depths if options.depths is not None else list(DEPTHS)
    needle = NEEDLE if options.needle is None else options.needle
    question = QUESTION if options.question is None else options.question
    answer = ANSWER if options.answer is None else options.answer
    for name, value in (("needle", needle), ("question", question), ("answer", answer)):
        if not isinstance(value, str) or not value.strip():
            raise RopeExtendError(f"{name} must be a non-empty string, got {value!r}")
    haystack = list(haystack)[: options.max_docs or None]
    texts = [t for t in haystack if t.strip()]
    if not texts:
        raise RopeExtendError("the haystack is empty: give at least one non-empty text")
    cache: dict[int, tuple[list[int], set[int]]] = {}

    def tokens(offset: int):
        if offset not in cache:
            ids = haystack_ids(tokenizer, texts[offset:] + texts[:offset], max(options.lengths))
            cache[offset] = (ids, sentence_ends(tokenizer, ids))
        return cache[offset]

    def make_trial(length: int, depth: float | None, trial: int) -> tuple[Prompt, str]:
        if depth is None:  # run_grid passes None only to a task without depths; niah always gives its grid
            raise RopeExtendError("a niah trial needs a needle depth, got none")
        offset = 0 if trial == 0 else trial_rng(seed, "niah", length, depth, trial).randrange(len(texts))
        ids, ends = tokens(offset)
        return build(tokenizer, length, depth, head=HEAD, needle=needle, tail=question, haystack=ids, ends=ends), answer

    return run_grid(
        model,
        tokenizer,
        task="niah",
        lengths=options.lengths,
        depths=grid,
        trials=options.trials,
        trials_at=options.trials_at,
        seed=seed,
        setting={
            "needle": needle,
            "question": question,
            "answer": answer,
            "depths": grid,
            "haystack_docs": len(texts),
            # the haystack's own text, so that records of another haystack are never reused for this one
            "haystack": short_hash("\n\n".join(texts)),
        },
        make_trial=make_trial,
        score=score,
        max_new_tokens=options.max_new_tokens,
        records=records,
        resume=resume,
        progress=progress,
        run=run,
        sliding_window=options.sliding_window,
    )
