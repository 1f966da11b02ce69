"""The ``perplexity`` task: token-weighted perplexity per length; the harness is
``evaluation.perplexity``."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from . import base
from .options import PerplexityOptions


def run(model, tokenizer, options: PerplexityOptions, context: base.Context) -> list[dict]:
    from ..perplexity import perplexity

    return perplexity(model, tokenizer, context.documents("perplexity"), options=options, **context.common()).records


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


TASK = base.Task(
    name="perplexity",
    help="token-weighted perplexity per length (chunked, no full logits)",
    title="Perplexity",
    options=PerplexityOptions,
    run=run,
    summarize=summarize,
    render=render,
    plot=plot,
)
