"""The ``ruler`` task: RULER's synthetic tasks per length; the harness is ``evaluation.ruler``."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from . import base
from .options import RulerOptions


def run(model, tokenizer, options: RulerOptions, context: base.Context) -> list[dict]:
    from ..ruler.harness import ruler

    return ruler(model, tokenizer, options=options, haystack=context.texts, **context.common()).records


def _reference(records: list[dict], lengths: list[int]) -> int:
    """The length the relative effective length is measured from: the model's original context when the run
    records one (a scaled model) and it was measured, else the shortest length measured."""
    original = {r.get("original_length") for r in records} - {None}
    if len(original) == 1 and (n := original.pop()) in lengths:
        return n
    return min(lengths)


def summarize(records: list[dict]) -> dict[str, list[dict]]:
    """Per (run, RULER task, length): the mean score with its Wilson interval, RULER's score (percent, rounded to
    2 decimals) and the empty answers; per (run, length): the average of RULER's task scores and how many tasks
    it is over; per run: the effective lengths (``effective.effective_lengths``, RULER's threshold, and 90% of
    the score at the original context or the shortest length)."""
    from ..effective import effective_lengths
    from ..report import label_of, proportion
    from ..ruler.scoring import tables
    from ..ruler.subtasks import RULER_TASKS

    runs: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        runs[label_of(r)].append(r)
    rows, effective = [], []
    for label, mine in runs.items():
        t = tables(mine)
        for name, by in t["accuracy"].items():
            for length in by:
                xs = [float(r["score"]) for r in mine if r["ruler_task"] == name and r["length"] == length]
                cell = proportion(xs)
                rows.append(
                    {
                        "label": label,
                        "task": name,
                        "length": length,
                        **cell,
                        "samples": cell["trials"],
                        "score": t["scores"][name][length],
                        "empty": t["empty"][name][length],
                    }
                )
        for length, avg in t["average"].items():
            rows.append(
                {
                    "label": label,
                    "task": "average",
                    "length": length,
                    "score": avg,
                    "accuracy": avg / 100,
                    "tasks": t["tasks"],
                    "ruler_tasks": RULER_TASKS,
                }
            )
        if t["average"]:
            eff = effective_lengths(t["average"], reference_length=_reference(mine, sorted(t["average"])))
            effective.append({"label": label, **eff.as_dict(), "tasks": t["tasks"]})
    return {"ruler": rows, "ruler_effective": effective}


def _cell(r: dict | None, average: bool) -> str:
    if r is None:
        return ""
    if average:
        return f"**{r['score']:.2f}**"
    empty = f"; {r['empty']} empty" if r.get("empty") else ""
    if "score" not in r:  # a summary written before RULER's rounding was reported
        return f"{100 * r['accuracy']:.1f}"
    return f"{r['score']:.2f} (n={r['trials']}; {100 * r['low']:.0f}-{100 * r['high']:.0f}{empty})"


def _effective_lines(eff: dict) -> list[str]:
    from ..report import length_name

    def name(n):
        return length_name(n) if n is not None else "none (no length reaches it)"

    return [
        (
            f"Effective length (RULER's rule: the longest length whose average is >= {eff['threshold']:g}, RULER's "
            f"threshold, Llama-2-7B's 13-task average at 4k; this average is over {eff['tasks']} tasks): "
            f"**{name(eff['length'])}**."
        ),
        "",
        (
            f"Relative effective length (the longest length keeping >= {100 * eff['keep']:g}% of the average at "
            f"{length_name(eff['reference_length'])}, {eff['reference_score']:.2f}): **{name(eff['relative_length'])}**."
        ),
        "",
    ]


def render(summary: dict) -> list[str]:
    """Per run, a task x length table of RULER's scores (string_match_all, percent rounded to 2 decimals as
    RULER) with the average labelled with its task count and the effective lengths; with several runs first the
    averages side by side."""
    from ..report import labels_of, length_name
    from ..ruler.scoring import average_label

    rows = summary.get("ruler")
    if not rows:
        return []
    effective = {e["label"]: e for e in summary.get("ruler_effective", [])}
    lines = ["## RULER synthetic tasks (string_match_all, %)", ""]
    lengths = sorted({r["length"] for r in rows})
    labels = labels_of(rows)
    averages = [r for r in rows if r["task"] == "average"]
    counts = sorted({r["tasks"] for r in averages})
    if len(labels) > 1 and averages:
        mean = {(r["label"], r["length"]): r for r in averages}
        lines += [
            f"Average ({' / '.join(average_label(c) for c in counts)}; not comparable to RULER's published averages):",
            "",
            "| length | " + " | ".join(labels) + " |",
            "|---:|" + "---:|" * len(labels),
        ]
        for n in lengths:
            cells = [_cell(mean.get((lb, n)), True) for lb in labels]
            lines.append(f"| {length_name(n)} | " + " | ".join(cells) + " |")
        lines.append("")
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        table = {(r["task"], r["length"]): r for r in mine}
        names = [t for t in dict.fromkeys(r["task"] for r in mine) if t != "average"]
        count = next((r["tasks"] for r in mine if r["task"] == "average"), len(names))
        lines += [
            f"### {label}",
            "",
            (
                "Each cell: RULER's score, the mean sample score in % rounded to 2 decimals (samples; 95% Wilson "
                "interval, %; answers left empty). The length holds the prompt and the tokens to generate, as RULER's."
            ),
            "",
        ]
        lines += ["| task | " + " | ".join(length_name(n) for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
        for name in names:
            lines.append(f"| {name} | " + " | ".join(_cell(table.get((name, n)), False) for n in lengths) + " |")
        if any(r["task"] == "average" for r in mine):
            cells = [_cell(table.get(("average", n)), True) for n in lengths]
            lines.append(f"| **{average_label(count)}** | " + " | ".join(cells) + " |")
        lines.append("")
        if label in effective:
            lines += _effective_lines(effective[label])
    return lines


def plot(summary: dict, out: Path) -> dict[str, Path]:
    """Per run, a RULER task x length heatmap (the average last)."""
    from ..report import labels_of, plot_heatmap, slug

    rows = summary.get("ruler", [])
    files = {}
    for label in labels_of(rows):
        name = f"ruler_heatmap_{slug(label)}"
        files[name] = plot_heatmap(
            [r for r in rows if r["label"] == label],
            out / f"{name}.png",
            title=f"RULER: {label}",
            row_key="task",
            row_names=str,
            ylabel="task",
            order=lambda names: [t for t in names if t != "average"] + ["average"],
        )
    return files


TASK = base.Task(
    name="ruler",
    help="RULER's synthetic tasks (needles, variable tracking, word counts) per length",
    title="RULER synthetic tasks",
    options=RulerOptions,
    run=run,
    summarize=summarize,
    render=render,
    plot=plot,
)
