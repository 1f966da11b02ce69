"""The options of the built-in tasks, one dataclass each: a suite's section, a subcommand's flags, and the
keywords of the task's harness (``evaluation.passkey``, ``niah``, ``perplexity``, ``ruler``), which builds them
with ``base.options_for``. Declared here, once, apart from the harnesses (they import torch) and the task modules
(which import their harness when run), so that both import them without a circle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import RopeExtendError
from ...hf.window import SlidingWindowMode
from ...schema import option
from ..data import parse_trials_at
from . import base


def _check_grid(options) -> None:
    """A retrieval grid's options (passkey, niah): lengths and depths parsed, ``trials_at`` read against the
    lengths, ``trials`` and ``max_new_tokens`` positive."""
    base.check_lengths(options)
    options.trials_at = parse_trials_at(options.trials_at, options.lengths)
    base.check_positive(options, "trials", "max_new_tokens")


@dataclass
class PasskeyOptions:
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
    sliding_window: SlidingWindowMode = option("auto", help=base.WINDOW_HELP)

    def __post_init__(self) -> None:
        _check_grid(self)
        pair = self.key_range if len(self.key_range) == 2 else []
        ints = [v for v in pair if isinstance(v, int) and not isinstance(v, bool)]
        if len(ints) != 2 or not 0 <= ints[0] <= ints[1]:
            raise RopeExtendError(f"key_range must be two integers 0 <= LOW <= HIGH, got {self.key_range!r}")
        self.key_range = ints


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
        _check_grid(self)


@dataclass(kw_only=True)
class PerplexityOptions(base.TextOptions):
    lengths: list[Any] = option(help="window lengths in tokens")
    stride: int | None = option(None, help="sliding-window step; null: one truncated window per document")
    chunk_size: int | None = option(None, help="positions per LM-head chunk (default: 16M logits / vocab)")
    sliding_window: SlidingWindowMode = option("auto", help=base.WINDOW_HELP)

    def __post_init__(self):
        base.check_lengths(self)
        base.check_positive(self, "stride", "chunk_size")
        if self.stride is not None and self.stride > min(self.lengths):
            raise RopeExtendError(
                f"stride {self.stride} is larger than the window length {min(self.lengths)}: tokens would be skipped"
            )


@dataclass(kw_only=True)
class RulerOptions(base.TextOptions):
    """RULER's synthetic tasks; ``data`` is the essay haystack (niah_single_2/3, niah_multikey_1, niah_multivalue,
    niah_multiquery)."""

    lengths: list[Any] = option(help="lengths in tokens; as RULER's, each holds the prompt and the tokens to generate")
    tasks: list[str] | None = option(
        None,
        help="RULER tasks: niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue, niah_multiquery, vt, cwe, fwe "
        "(default: all eleven)",
    )
    samples: int = option(10, help="prompts per task and length")
    seed: int = option(0, help="seed")
    max_new_tokens: int | None = option(None, help="tokens generated (default: RULER's per task)")
    chat_template: bool = option(
        True, help="wrap prompts in the tokenizer's chat template when it has one, as RULER does for instruct models"
    )
    sliding_window: SlidingWindowMode = option("auto", help=base.WINDOW_HELP)

    def __post_init__(self):
        from ..ruler.subtasks import check_tasks

        base.check_lengths(self)
        base.check_positive(self, "samples", "max_new_tokens")
        if self.tasks is not None:
            self.tasks = check_tasks(self.tasks)
