"""The ``niah`` task: needle in a haystack (Kamradt 2023); its options, its harness ``niah()`` and its ``TASK`` in
one module.

A user-given needle sentence is placed at a depth (on a sentence boundary) in a haystack of real text, over a
length x depth grid; scored by substring match (the answer, case-insensitive, appears in the greedy output), not
by an LLM judge. The deliverable is the heatmap.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import RopeExtendError
from ..hf.window import SlidingWindowMode
from ..schema import option
from . import retrieval_task
from .passkey import trial_rng
from .prompts import Prompt, build, haystack_ids, sentence_ends
from .records import short_hash
from .retrieval import RetrievalResult, run_grid
from .tasks.base import WINDOW_HELP, Context, Task, TextOptions, options_for

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco? Answer: The best thing to do in San Francisco is"
ANSWER = "Dolores Park"
HEAD = "Read the document below and answer the question at the end."
DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]


@dataclass(kw_only=True)
class NiahOptions(TextOptions):
    """The niah task's options: a suite's section, the subcommand's flags and ``niah()``'s keywords (of the text
    options only ``max_docs``: the harness takes the haystack itself)."""

    lengths: list[Any] = option(help="prompt lengths in tokens")
    needle: str | None = option(None, help="the sentence to hide (default: the San Francisco needle)")
    question: str | None = option(None, help="the question asked at the end")
    answer: str | None = option(None, help="the substring a correct answer contains")
    depths: Any = option(None, help="depth grid: 0,0.5,1 or 0%,50%,100% or grid:N (default 0, 25, 50, 75, 100%)")
    trials: int = option(1, help="trials per cell (each from another haystack document)")
    trials_at: dict[Any, int] | None = option(
        None, help="other trial counts at particular lengths, e.g. {16k: 10} (each a length of lengths)"
    )
    seed: int = option(0, help="seed")
    max_new_tokens: int = option(32, help="tokens generated for the answer")
    sliding_window: SlidingWindowMode = option("auto", help=WINDOW_HELP)

    def __post_init__(self):
        retrieval_task.check_grid(self)


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


# ------------------------------------------------------------------------------------------ the task
def _run(model, tokenizer, options: NiahOptions, context: Context) -> list[dict]:
    return niah(model, tokenizer, context.documents("niah"), options=options, **context.common()).records


TASK = Task(
    name="niah",
    help="needle in a haystack: length x depth heatmap, substring match",
    title="Needle in a haystack",
    options=NiahOptions,
    run=_run,
    summarize=lambda records: retrieval_task.summarize("niah", records),
    render=lambda summary: retrieval_task.render(summary, "niah", "Needle in a haystack accuracy"),
    plot=lambda summary, out: retrieval_task.heatmaps(summary, out, "niah", "Needle"),
)
