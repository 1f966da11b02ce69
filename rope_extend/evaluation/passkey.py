"""Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention"; the protocol of YaRN, LongLoRA,
LongRoPE and Self-Extend).

A random integer key is hidden at a depth in repeated filler; the model is asked for it with greedy
decoding (about 10 new tokens); the first integer in its output must equal the key. Lengths are token
counts of the whole prompt in the model's own tokenizer. Accuracy per length (and per depth with a grid).
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterable
from typing import Any

from .prompts import passkey_prompt, split_sentences
from .records import short_hash
from .retrieval import RetrievalResult, run_grid
from .tasks.base import options_for
from .tasks.options import PasskeyOptions

_INTEGER = re.compile(r"\d+")


def first_integer(text: str) -> int | None:
    """The first run of digits in ``text`` as an int (``"is 4213. Rem"`` -> 4213), or None."""
    match = _INTEGER.search(text)
    return int(match.group()) if match else None


def score(output: str, key: int) -> tuple[int | None, bool]:
    """Exact match of the first integer in the output with the key."""
    prediction = first_integer(output)
    return prediction, prediction == key


def trial_rng(seed: int, task: str, length: int, depth: float | None, trial: int) -> random.Random:
    """One RNG per trial, from its coordinates only: any subset of trials (a resumed run) gets the same draws."""
    return random.Random(f"{task}:{seed}:{length}:{depth}:{trial}")


def passkey(
    model,
    tokenizer,
    lengths: str | Iterable[Any] | None = None,
    *,
    options: PasskeyOptions | None = None,
    records: str | os.PathLike | None = None,
    resume: bool = False,
    progress: bool = True,
    run: dict[str, Any] | None = None,
    filler: str | Iterable[str] | None = None,
    **given: Any,
) -> RetrievalResult:
    """Passkey accuracy of ``model`` at each of ``lengths`` (token counts, e.g. ``"1k,2k,4k"``).

    The options are ``PasskeyOptions``'s (the task's, declared once), given as keywords or as ``options=``:
    ``depths=None`` draws a uniform random depth per trial; a list (``[0, 0.5, 1]`` or ``"grid:5"``) runs
    ``trials`` trials at each depth, and ``.accuracy`` is then keyed by ``(length, depth)``; ``trials_at``
    (``{"16k": 10}``) sets other counts at particular lengths. ``key_range`` is inclusive (published runs use
    1..50000); ``sliding_window`` is the runner's policy (``"auto"``, ``"full"``, ``"keep"``; see
    ``evaluation.runner``).

    ``records`` is a JSONL file each trial is appended to; with ``resume=True`` the trials already in it are
    not run again. ``run`` adds fields (e.g. a label) to records. ``filler`` (a text, or a list of sentences)
    replaces the protocol's repeated filler; each trial then reads it from a random sentence on (drawn after
    the key and the depth, so keys and depths are those of the standard filler's trials).
    """
    if lengths is not None:
        given["lengths"] = lengths
    options = options_for(PasskeyOptions, options, given, harness="passkey")
    seed, (low, high) = options.seed, options.key_range
    sentences = None if filler is None else split_sentences(filler if isinstance(filler, str) else list(filler))
    setting: dict[str, Any] = {"key_range": [low, high], "depths": options.depths}
    if sentences is not None:  # only then: the standard filler's records keep their setting id
        setting["filler"] = short_hash("\n".join(sentences))

    def make_trial(length: int, depth: float | None, trial: int):
        rng = trial_rng(seed, "passkey", length, depth, trial)
        key = rng.randint(low, high)
        where = rng.random() if depth is None else depth
        if sentences is None:
            return passkey_prompt(tokenizer, length, key, where), key
        start = rng.randrange(len(sentences))
        return passkey_prompt(tokenizer, length, key, where, filler=sentences, start=start), key

    return run_grid(
        model,
        tokenizer,
        task="passkey",
        lengths=options.lengths,
        depths=options.depths,
        trials=options.trials,
        trials_at=options.trials_at,
        seed=seed,
        setting=setting,
        make_trial=make_trial,
        score=score,
        max_new_tokens=options.max_new_tokens,
        records=records,
        resume=resume,
        progress=progress,
        run=run,
        sliding_window=options.sliding_window,
    )
