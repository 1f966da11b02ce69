"""The ``niah`` task: needle in a haystack, a length x depth heatmap; the harness is ``evaluation.niah``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...hf.window import SlidingWindowMode
from ...schema import option
from ..data import parse_trials_at
from . import _retrieval, base


@dataclass(kw_only=True)
class NiahOptions(base.TextOptions):
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
    sliding_window: SlidingWindowMode = option("auto", help=base.WINDOW_HELP)

    def __post_init__(self):
        base.check_lengths(self)
        self.trials_at = parse_trials_at(self.trials_at, self.lengths)
        base.check_positive(self, "trials", "max_new_tokens")


def run(model, tokenizer, options: NiahOptions, context: base.Context) -> list[dict]:
    from ..niah import niah

    return niah(model, tokenizer, context.texts, options=options, **context.common()).records


TASK = base.register_task(
    base.Task(
        name="niah",
        help="needle in a haystack: length x depth heatmap, substring match",
        title="Needle in a haystack",
        options=NiahOptions,
        run=run,
        summarize=lambda records: _retrieval.summarize("niah", records),
        render=lambda summary: _retrieval.render(summary, "niah", "Needle in a haystack accuracy"),
        plot=lambda summary, out: _retrieval.heatmaps(summary, out, "niah", "Needle"),
    )
)
