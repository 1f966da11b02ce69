"""The ``perplexity`` task: token-weighted perplexity per length; the harness is
``evaluation.perplexity``."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import RopeExtendError
from ...hf.window import SlidingWindowMode
from ...schema import option
from . import base


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


def run(model, tokenizer, options: PerplexityOptions, context: base.Context) -> list[dict]:
    from ..perplexity import perplexity

    return perplexity(model, tokenizer, context.texts, options=options, **context.common()).records


def summarize(records: list[dict]) -> dict[str, list[dict]]:
    """Per (run, length): exp(sum of NLL / sum of tokens) over the documents (token-weighted)."""
    from ..report import label_of

    sums: dict = defaultdict(lambda: [0.0, 0, 0])
    for r in records:
        row = sums[(label_of(r), r["length"])]
        row[0] += r["nll"]
        row[1] += r["tokens"]
        row[2] += 1
    return {
        "perplexity": [
            {
                "label": label,
                "length": length,
                "perplexity": math.exp(nll / tokens) if tokens else None,
                "tokens": tokens,
                "docs": docs,
            }
            for (label, length), (nll, tokens, docs) in sums.items()
        ]
    }


def render(summary: dict) -> list[str]:
    from ..report import length_table, perplexity_cell

    rows = summary.get("perplexity")
    return length_table(rows, "Perplexity (token-weighted; lower is better)", perplexity_cell) if rows else []


def plot(summary: dict, out: Path) -> dict[str, Path]:
    from ..report import plot_lines

    if not summary.get("perplexity"):
        return {}
    path = plot_lines(
        summary["perplexity"],
        "perplexity",
        out / "perplexity.png",
        title="Perplexity vs context length",
        ylabel="perplexity (log)",
        log_y=True,
    )
    return {"perplexity_plot": path}


TASK = base.register_task(
    base.Task(
        name="perplexity",
        help="token-weighted perplexity per length (chunked, no full logits)",
        title="Perplexity",
        options=PerplexityOptions,
        run=run,
        summarize=summarize,
        render=render,
        plot=plot,
    )
)
