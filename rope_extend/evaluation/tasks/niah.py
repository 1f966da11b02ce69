"""The ``niah`` task: needle in a haystack, a length x depth heatmap; the harness is ``evaluation.niah``."""

from __future__ import annotations

from . import _retrieval, base
from .options import NiahOptions


def run(model, tokenizer, options: NiahOptions, context: base.Context) -> list[dict]:
    from ..niah import niah

    return niah(model, tokenizer, context.documents("niah"), options=options, **context.common()).records


TASK = base.Task(
    name="niah",
    help="needle in a haystack: length x depth heatmap, substring match",
    title="Needle in a haystack",
    options=NiahOptions,
    run=run,
    summarize=lambda records: _retrieval.summarize("niah", records),
    render=lambda summary: _retrieval.render(summary, "niah", "Needle in a haystack accuracy"),
    plot=lambda summary, out: _retrieval.heatmaps(summary, out, "niah", "Needle"),
)
