"""The ``passkey`` task: passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention"; the protocol of YaRN,
LongLoRA, LongRoPE and Self-Extend); its options, its harness ``passkey()`` and its ``TASK`` in one module.

A random integer key is hidden at a depth in repeated filler; the model is asked for it with greedy
decoding (about 10 new tokens); the first integer in its output must equal the key. Lengths are token
counts of the whole prompt in the model's own tokenizer. Accuracy per length (and per depth with a grid).
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import RopeExtendError
from ..hf.window import SlidingWindowMode
from ..schema import option
from . import report, retrieval_task
from .prompts import passkey_prompt, split_sentences
from .records import short_hash
from .retrieval import RetrievalResult, run_grid
from .tasks.base import WINDOW_HELP, Context, Task, options_for


@dataclass
class PasskeyOptions:
    """The passkey task's options: a suite's section, the subcommand's flags and ``passkey()``'s keywords."""

    lengths: list[Any] = option(help="prompt lengths in tokens, e.g. [4k, 8k] (1k = 1024)")
    depths: Any = option(
        None, help="null: a random depth per trial; a list (0,0.5,1) or grid:N: a depth x length heatmap"
    )
    trials: int = option(10, help="trials per length (per cell with depths)")
    trials_at: dict[Any, int] | None = option(
        None, help="other trial counts at particular lengths, e.g. {16k: 10} (each a length of lengths)"
    )
    seed: int = option(0, help="seed of the keys and depths")
    key_range: list[int] = option(help="inclusive range of the keys, LOW HIGH", factory=lambda: [1, 50000])
    max_new_tokens: int = option(10, help="tokens generated for the answer")
    sliding_window: SlidingWindowMode = option("auto", help=WINDOW_HELP)

    def __post_init__(self) -> None:
        retrieval_task.check_grid(self)
        pair = self.key_range if len(self.key_range) == 2 else []
        ints = [v for v in pair if isinstance(v, int) and not isinstance(v, bool)]
        if len(ints) != 2 or not 0 <= ints[0] <= ints[1]:
            raise RopeExtendError(f"key_range must be two integers 0 <= LOW <= HIGH, got {self.key_range!r}")
        self.key_range = ints


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


# ------------------------------------------------------------------------------------------ the task
def _run(model, tokenizer, options: PasskeyOptions, context: Context) -> list[dict]:
    return passkey(model, tokenizer, options=options, **context.common()).records


def _plot(summary: dict, out: Path) -> dict[str, Path]:
    files = retrieval_task.heatmaps(summary, out, "passkey", "Passkey")
    if summary.get("passkey"):
        files["passkey_plot"] = report.plot_lines(
            summary["passkey"], "accuracy", out / "passkey.png", title="Passkey retrieval", ylabel="accuracy (%)"
        )
    return files


TASK = Task(
    name="passkey",
    help="passkey retrieval accuracy per length (and depth)",
    title="Passkey retrieval",
    options=PasskeyOptions,
    run=_run,
    summarize=lambda records: retrieval_task.summarize("passkey", records),
    render=lambda summary: retrieval_task.render(summary, "passkey", "Passkey retrieval accuracy", context=True),
    plot=_plot,
)
