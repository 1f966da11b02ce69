"""The ``passkey`` task: passkey retrieval per length (and per depth); the harness is
``evaluation.passkey``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import RopeExtendError
from ...hf.window import SlidingWindowMode
from ...schema import option
from ..data import parse_trials_at
from . import _retrieval, base


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

    def __post_init__(self):
        base.check_lengths(self)
        self.trials_at = parse_trials_at(self.trials_at, self.lengths)
        base.check_positive(self, "trials", "max_new_tokens")
        low, high = self.key_range if len(self.key_range) == 2 else (None, None)
        if not (isinstance(low, int) and isinstance(high, int) and not isinstance(low, bool) and 0 <= low <= high):
            raise RopeExtendError(f"key_range must be two integers 0 <= LOW <= HIGH, got {self.key_range!r}")
        self.key_range = [low, high]


def run(model, tokenizer, options: PasskeyOptions, context: base.Context) -> list[dict]:
    from ..passkey import passkey

    return passkey(model, tokenizer, options=options, **context.common()).records


def plot(summary: dict, out: Path) -> dict[str, Path]:
    from .. import report

    files = _retrieval.heatmaps(summary, out, "passkey", "Passkey")
    if summary.get("passkey"):
        files["passkey_plot"] = report.plot_lines(
            summary["passkey"], "accuracy", out / "passkey.png", title="Passkey retrieval", ylabel="accuracy (%)"
        )
    return files


TASK = base.register_task(
    base.Task(
        name="passkey",
        help="passkey retrieval accuracy per length (and depth)",
        title="Passkey retrieval",
        options=PasskeyOptions,
        run=run,
        summarize=lambda records: _retrieval.summarize("passkey", records),
        render=lambda summary: _retrieval.render(summary, "passkey", "Passkey retrieval accuracy", context=True),
        plot=plot,
    )
)
