"""What the retrieval tasks (passkey, needle) share as tasks: the checks of their grid options, accuracy per length
and per depth, and their pictures. What their harnesses share (greedy generation, the grid run) is ``retrieval``."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from . import report
from .data import parse_trials_at
from .tasks.base import check_lengths, check_positive


def check_grid(options) -> None:
    """A retrieval grid's options (passkey, niah): lengths and depths parsed, ``trials_at`` read against the
    lengths, ``trials`` and ``max_new_tokens`` positive."""
    check_lengths(options)
    options.trials_at = parse_trials_at(options.trials_at, options.lengths)
    check_positive(options, "trials", "max_new_tokens")


def summarize(name: str, records: list[dict]) -> dict[str, list[dict]]:
    """``{name: rows per (run, length)}``, plus ``{name}_depth`` rows per (run, length, depth) for the
    records of a depth grid."""
    out = {name: report.accuracy_rows(records)}
    cells: dict = defaultdict(list)
    for r in records:
        if r.get("depth_grid") is not None:
            cells[(report.label_of(r), r["length"], r["depth_grid"])].append(bool(r["correct"]))
    if cells:
        out[f"{name}_depth"] = [
            {"label": label, "length": length, "depth": depth, **report.proportion(xs)}
            for (label, length, depth), xs in cells.items()
        ]
    return out


NOTE = "Each cell: accuracy (correct/trials; 95% Wilson interval, %)."


def render(summary: dict, name: str, heading: str, *, context: bool = False) -> list[str]:
    """The accuracy table; with ``context`` a last row gives each run's passkey context (>= 80%)."""
    rows = summary.get(name)
    if not rows:
        return []
    footer = None
    if context:

        def footer(label: str) -> str:
            found = report.passkey_context(rows, label)
            return report.length_name(found) if found else "-"

    return report.length_table(
        rows, heading, report.accuracy_cell, note=NOTE, footer=footer, footer_name="context (>= 80%)"
    )


def heatmaps(summary: dict, out: Path, name: str, what: str) -> dict[str, Path]:
    """One depth x length heatmap per run of a depth grid."""
    rows = summary.get(f"{name}_depth", [])
    files = {}
    for label in report.labels_of(rows):
        key = f"{name}_heatmap_{report.slug(label)}"
        files[key] = report.plot_heatmap(
            [r for r in rows if r["label"] == label], out / f"{key}.png", title=f"{what} retrieval: {label}"
        )
    return files
