"""The ``ruler`` task: RULER's synthetic tasks per length; the harness is ``evaluation.ruler``."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...hf.window import SlidingWindowMode
from ...schema import option
from . import base


@dataclass(kw_only=True)
class RulerOptions(base.TextOptions):
    """RULER's synthetic tasks; ``data`` is the essay haystack (niah_multivalue, niah_multiquery)."""

    lengths: list[Any] = option(help="prompt lengths in tokens")
    tasks: list[str] | None = option(
        None,
        help="RULER tasks: niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue, niah_multiquery, vt, cwe, fwe "
        "(default: all eleven)",
    )
    samples: int = option(10, help="prompts per task and length")
    seed: int = option(0, help="seed")
    max_new_tokens: int | None = option(None, help="tokens generated (default: RULER's per task)")
    sliding_window: SlidingWindowMode = option("auto", help=base.WINDOW_HELP)

    def __post_init__(self):
        from ..ruler import check_tasks

        base.check_lengths(self)
        base.check_positive(self, "samples", "max_new_tokens")
        if self.tasks is not None:
            self.tasks = check_tasks(self.tasks)


def run(model, tokenizer, options: RulerOptions, context: base.Context) -> list[dict]:
    from ..ruler import ruler

    return ruler(model, tokenizer, haystack=context.texts, **base.harness_options(options), **context.common()).records


def summarize(records: list[dict]) -> dict[str, list[dict]]:
    """Per (run, RULER task, length) the mean score, and per (run, length) the average over the tasks."""
    from ..report import label_of, proportion

    scores: dict = defaultdict(list)
    for r in records:
        scores[(label_of(r), r["ruler_task"], r["length"])].append(float(r["score"]))
    rows, means = [], defaultdict(list)
    for (label, name, length), xs in scores.items():
        cell = proportion(xs)
        rows.append({"label": label, "task": name, "length": length, **cell, "samples": cell["trials"]})
        means[(label, length)].append(sum(xs) / len(xs))
    for (label, length), accs in means.items():
        rows.append(
            {"label": label, "task": "average", "length": length, "accuracy": sum(accs) / len(accs), "tasks": len(accs)}
        )
    return {"ruler": rows}


def render(summary: dict) -> list[str]:
    """Per run, a task x length table of RULER accuracy (string_match_all, %) with the average over tasks;
    with several runs first the averages side by side."""
    from ..report import labels_of, length_name

    rows = summary.get("ruler")
    if not rows:
        return []
    lines = ["## RULER synthetic tasks (string_match_all accuracy)", ""]
    lengths = sorted({r["length"] for r in rows})
    labels = labels_of(rows)
    if len(labels) > 1:
        mean = {(r["label"], r["length"]): r["accuracy"] for r in rows if r["task"] == "average"}
        lines += [
            "Average over tasks:",
            "",
            "| length | " + " | ".join(labels) + " |",
            "|---:|" + "---:|" * len(labels),
        ]
        for n in lengths:
            cells = [f"{100 * mean[(lb, n)]:.1f}" if (lb, n) in mean else "" for lb in labels]
            lines.append(f"| {length_name(n)} | " + " | ".join(cells) + " |")
        lines.append("")
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        table = {(r["task"], r["length"]): r for r in mine}
        names = [t for t in dict.fromkeys(r["task"] for r in mine) if t != "average"]
        lines += [f"### {label}", "", "Each cell: mean score (samples; 95% Wilson interval, %).", ""]
        lines += ["| task | " + " | ".join(length_name(n) for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
        for name in [*names, "average"]:
            cells = []
            for n in lengths:
                r = table.get((name, n))
                if r and name == "average":
                    note = f" ({r['tasks']} tasks)" if r["tasks"] != len(names) else ""
                elif r and "low" in r:
                    note = f" (n={r['trials']}; {100 * r['low']:.0f}-{100 * r['high']:.0f})"
                else:
                    note = ""
                cells.append(f"{100 * r['accuracy']:.1f}{note}" if r else "")
            shown = f"**{name}**" if name == "average" else name
            lines.append(f"| {shown} | " + " | ".join(cells) + " |")
        lines.append("")
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


TASK = base.register_task(
    base.Task(
        name="ruler",
        help="RULER's synthetic tasks (needles, variable tracking, word counts) per length",
        title="RULER synthetic tasks",
        options=RulerOptions,
        run=run,
        summarize=summarize,
        render=render,
        plot=plot,
    )
)
