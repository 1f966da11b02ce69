"""Reports for people and machines: results JSON (summary + every record), CSV of records, a markdown
report and PNG plots. Each task gives its own sections and plots (``evaluation.tasks``); this module holds
what they share: labels, Wilson intervals, length tables, line plots and heatmaps. Every file is written
atomically (``rope_extend.io.atomic_path``)."""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ..io import atomic_path, write_json, write_text


def label_of(record: dict) -> str:
    """A run's name in tables and legends: its ``label``, else ``method xfactor`` (``none`` unscaled; ``(config)``
    when the scaling is the model's own, read from its config, not a patch)."""
    if record.get("label"):
        return str(record["label"])
    if record.get("method", "none") == "none":
        return "none"
    own = " (config)" if record.get("scaling_from") == "config" else ""
    return f"{record['method']} x{record.get('factor', 1):g}{own}"


def wilson(successes: float, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval for a proportion (Wilson 1927), 95% by default (z = 1.96):

        centre = (p + z^2 / 2n) / (1 + z^2 / n),   half = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2)

    with p = successes / n. Unlike p +- z sqrt(p(1-p)/n) it stays inside [0, 1] and is not empty at p = 0 or 1:
    5 of 5 gives [0.57, 1], 0 of 5 gives [0, 0.43]. ``successes`` may be a sum of fractional scores (RULER's
    multi-value tasks), where the interval is the same formula on the mean score."""
    if trials <= 0:
        return (0.0, 1.0)
    p = min(max(successes / trials, 0.0), 1.0)
    z2 = z * z
    denominator = 1 + z2 / trials
    centre = (p + z2 / (2 * trials)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials))
    low = 0.0 if p == 0.0 else max(0.0, centre - half)  # exactly 0 (and 1) there; rounding would leave 1e-17
    high = 1.0 if p == 1.0 else min(1.0, centre + half)
    return (low, high)


def proportion(xs: Sequence[float]) -> dict:
    """accuracy, trials, correct (a count for 0/1 outcomes) and the 95% Wilson interval ``low``..``high``."""
    total = float(sum(xs))
    low, high = wilson(total, len(xs))
    correct = int(total) if total == int(total) else round(total, 3)
    return {"accuracy": total / len(xs), "trials": len(xs), "correct": correct, "low": low, "high": high}


def length_name(n: int) -> str:
    """``4096`` -> ``4k``; a length that is not a whole number of k stays as it is."""
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


def labels_of(rows: Sequence[dict]) -> list[str]:
    """The runs' labels in first-seen order."""
    return list(dict.fromkeys(r["label"] for r in rows))


def accuracy_rows(records: Iterable[dict], key=lambda r: bool(r["correct"])) -> list[dict]:
    """One row per (run, length) of 0/1 (or fractional) outcomes: accuracy, count and Wilson interval."""
    groups: dict = defaultdict(list)
    for r in records:
        groups[(label_of(r), r["length"])].append(key(r))
    return [{"label": label, "length": length, **proportion(xs)} for (label, length), xs in groups.items()]


def summarize(records: Iterable[dict]) -> dict[str, list[dict]]:
    """Per section, one row per (run, length) (and per depth for heatmaps), in first-seen run order: each
    registered task summarizes its own records (``evaluation.tasks``); records of no registered task are
    left out of the summary (they stay in results.json and the CSV)."""
    from .tasks.base import tasks

    records = list(records)
    out: dict[str, list[dict]] = {}
    for task in tasks():
        mine = [r for r in records if r.get("task") == task.name]
        if mine:
            out.update(task.summarize(mine))
    return out


def passkey_context(rows: Sequence[dict], label: str, threshold: float = 0.8) -> int | None:
    """YaRN's passkey context: the largest length whose accuracy is >= ``threshold``."""
    ok = [r["length"] for r in rows if r["label"] == label and r["accuracy"] >= threshold]
    return max(ok) if ok else None


def accuracy_cell(row: dict) -> str:
    """``80% (4/5; 38-96)``: the accuracy, the count behind it and its 95% Wilson interval in percent."""
    if "low" not in row:  # a summary written before intervals were reported
        return f"{100 * row['accuracy']:.0f}%"
    return f"{100 * row['accuracy']:.0f}% ({row['correct']:g}/{row['trials']}; {100 * row['low']:.0f}-{100 * row['high']:.0f})"


def perplexity_cell(row: dict) -> str:
    v = row["perplexity"]
    return "" if v is None else f"{v:.3f}" if v < 1e4 else f"{v:.3g}"


def length_table(
    rows: Sequence[dict],
    heading: str,
    cell: Callable[[dict], str],
    *,
    note: str | None = None,
    footer: Callable[[str], str] | None = None,
    footer_name: str = "",
) -> list[str]:
    """A markdown section: a row per length, a column per run, ``cell(row)`` in each; ``footer(label)`` adds
    a last row named ``footer_name``."""
    labels = labels_of(rows)
    table = {(r["label"], r["length"]): r for r in rows}
    lines = [f"## {heading}", ""] + ([note, ""] if note else [])
    lines += ["| length | " + " | ".join(labels) + " |", "|---:|" + "---:|" * len(labels)]
    for length in sorted({r["length"] for r in rows}):
        cells = [cell(table[(lb, length)]) if (lb, length) in table else "" for lb in labels]
        lines.append(f"| {length_name(length)} | " + " | ".join(cells) + " |")
    if footer is not None:
        lines.append(f"| {footer_name} | " + " | ".join(footer(lb) for lb in labels) + " |")
    return [*lines, ""]


def markdown(summary: dict[str, list[dict]], title: str = "Results", notes: Sequence[str] = ()) -> str:
    """The title, the notes, then each registered task's section(s) in registration order."""
    from .tasks.base import tasks

    lines = [f"# {title}", ""] + [f"{n}  " for n in notes] + ([""] if notes else [])
    for task in tasks():
        lines += task.render(summary)
    return "\n".join(lines) + "\n"


def write_csv(path: str | Path, records: Sequence[dict]) -> Path:
    fields = list(dict.fromkeys(k for r in records for k in r))
    with atomic_path(path) as tmp, tmp.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in records:
            writer.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in r.items()})
    return Path(path)


# ------------------------------------------------------------------------------------------ plots
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    _pyplot().close(fig)
    return Path(path)


def _length_axis(ax, lengths: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths)
    ax.set_xticklabels([length_name(n) for n in lengths])
    ax.minorticks_off()


def plot_lines(
    rows: Sequence[dict], key: str, path: str | Path, *, title: str, ylabel: str, log_y: bool = False
) -> Path:
    """``key`` vs length, one line per run, saved as a PNG (``line_figure``)."""
    fig, _ = line_figure(rows, key, title=title, ylabel=ylabel, log_y=log_y)
    return _save(fig, path)


def robust_top(values: Sequence[float], spread: float = 4.0) -> float | None:
    """The largest value within ``spread`` times the median of the finite values, or None when every value is
    (nothing to clip). A method that failed (linear x4 near 200 beside eight methods at 2.2-3.5) would
    otherwise stretch the axis and press the rest into one line."""
    import statistics

    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return None
    kept = [v for v in finite if v <= spread * statistics.median(finite)]
    return None if len(kept) == len(finite) else max(kept)


def line_figure(rows: Sequence[dict], key: str, *, title: str, ylabel: str, log_y: bool = False):
    """``(fig, ax)``: ``key`` vs length, one line per run (accuracy or perplexity). Each run has its own colour,
    marker and dash (``rope_extend.plotting.styles``) and the legend sits outside the axes.

    Accuracy points carry their 95% Wilson interval as thin capped bars, and runs are nudged apart along the
    length axis (together at most 0.4 of an octave, log scale) so that runs at the same value (several at 100%)
    stay side by side. Perplexity is clipped above at ``robust_top`` (with headroom): a value beyond it is drawn
    as a triangle on the top edge, its value written beside it, so the others keep the height of the axis."""
    from ..plotting import legend_outside, styles

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    lengths = sorted({r["length"] for r in rows})
    labels = labels_of(rows)
    look = styles(labels)
    top = None if key == "accuracy" else _clip_top([r[key] for r in rows], log_y)
    step = min(0.06, 0.4 / (len(labels) - 1)) if key == "accuracy" and len(labels) > 1 else 0.0
    for k, label in enumerate(labels):
        mine = sorted((r for r in rows if r["label"] == label and r[key] is not None), key=lambda r: r["length"])
        nudge = 2 ** (step * (k - (len(labels) - 1) / 2))
        xs = [r["length"] * nudge for r in mine]
        style = {**look[label], "markersize": 6, "alpha": 0.9, "label": label}
        if key == "accuracy":
            _accuracy_series(ax, xs, mine, style)
        else:
            _clipped_series(ax, xs, [r[key] for r in mine], top, style)
    _length_axis(ax, lengths)
    if log_y:
        _log_y(ax)
    if key == "accuracy":
        ax.set_ylim(-5, 105)
        ax.text(1.01, 0.0, "bars: 95% Wilson interval", transform=ax.transAxes, fontsize=7, va="bottom")
    elif top is not None:
        ax.set_ylim(top=top)
        note = "▲ on the top edge: above the axis,\nits value written beside it"
        ax.text(1.01, 0.0, note, transform=ax.transAxes, fontsize=7, va="bottom")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    legend_outside(ax)  # outside the axes, so that it never covers a point
    return fig, ax


def _clip_top(values: Sequence[float | None], log_y: bool) -> float | None:
    """Where the y axis ends when ``robust_top`` clips: the largest kept value plus 12% of the kept range
    (of its log on a log axis) as headroom for the clip marks."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    kept = robust_top(finite)
    if kept is None:
        return None
    low = min(finite)
    return kept * (kept / low) ** 0.12 if log_y else kept + 0.12 * (kept - low)


def _accuracy_series(ax, xs: list[float], rows: list[dict], style: dict) -> None:
    ys = [100 * r["accuracy"] for r in rows]
    if not all("low" in r for r in rows):  # a summary written before intervals were reported
        ax.plot(xs, ys, **style)
        return
    below = [100 * (r["accuracy"] - r["low"]) for r in rows]
    above = [100 * (r["high"] - r["accuracy"]) for r in rows]
    bars = ax.errorbar(xs, ys, yerr=[below, above], capsize=2, elinewidth=0.6, capthick=0.6, **style)
    for line in bars[2]:
        line.set_alpha(0.45)  # thin and faint: behind the points, not a forest in front of them


def _clipped_series(ax, xs: list[float], ys: list[float], top: float | None, style: dict) -> None:
    if top is None:
        ax.plot(xs, ys, **style)
        return
    ax.plot(xs, [min(y, top) for y in ys], **style)
    colour = style["color"]
    for x, y in zip(xs, ys, strict=True):
        if y > top:
            ax.plot([x], [top], marker="^", color=colour, markersize=9, clip_on=False, linestyle="none")
            ax.annotate(f"{y:.3g}", (x, top), xytext=(5, -11), textcoords="offset points", fontsize=7, color=colour)


def _log_y(ax) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(LogLocator(subs=(2, 5)))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def plot_heatmap(
    rows: Sequence[dict],
    path: str | Path,
    *,
    title: str,
    row_key: str = "depth",
    row_names=lambda d: f"{100 * d:.0f}%",
    ylabel: str = "needle depth",
    order=sorted,
) -> Path:
    """``row_key`` (y; by default the depth, 0% at the top) x length (x) accuracy grid, red (0%) to green
    (100%), values written in."""
    plt = _pyplot()
    lengths = sorted({r["length"] for r in rows})
    depths = list(order(dict.fromkeys(r[row_key] for r in rows)))
    grid = [[float("nan")] * len(lengths) for _ in depths]
    counts = [[""] * len(lengths) for _ in depths]
    for r in rows:
        i, j = depths.index(r[row_key]), lengths.index(r["length"])
        grid[i][j] = r["accuracy"]
        if "correct" in r:  # a mean of fractional scores shows its sample count, a count of successes as k/n
            counts[i][j] = (
                f"\n{r['correct']}/{r['trials']}" if r["correct"] == int(r["correct"]) else f"\nn={r['trials']}"
            )
    fig, ax = plt.subplots(figsize=(1.0 + 0.7 * len(lengths), 1.0 + 0.55 * len(depths)))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if grid[i][j] == grid[i][j]:
                ax.text(j, i, f"{100 * grid[i][j]:.0f}%{counts[i][j]}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(lengths)), [length_name(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [row_names(d) for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label="accuracy")
    return _save(fig, path)


def slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


FILES = ("records.jsonl", "results.json", "results.csv", "report.md", "suite.yaml")


def owned(name: str) -> bool:
    """Whether ``name`` is a file an evaluation writes into its output folder (records, reports, plots)."""
    return name in FILES or name.endswith(".png")


def time_table(records: Sequence[dict]) -> list[str]:
    """A markdown section: per run and task, the wall time its records took to measure (their ``seconds``; each
    record times its own job, so model loading and patching are not in it) and the CPU time (``cpu_seconds``,
    every thread), and how many records carry them (records written before they were timed, or imported from
    such a run, do not). Empty without any."""
    if not any("seconds" in r for r in records):
        return []
    cells: dict[tuple[str, str], list] = {}
    for r in records:
        cell = cells.setdefault((label_of(r), str(r.get("task"))), [0.0, 0.0, 0, 0])
        cell[3] += 1
        if isinstance(r.get("seconds"), (int, float)):
            cell[0] += r["seconds"]
            cell[1] += r.get("cpu_seconds") or 0.0
            cell[2] += 1
    lines = [
        "## Evaluation time",
        "",
        "| run | task | timed records | seconds | CPU seconds |",
        "|---|---|---:|---:|---:|",
    ]
    for (label, task), (seconds, cpu, timed, total) in cells.items():
        lines.append(f"| {label} | {task} | {timed} of {total} | {seconds:.0f} | {cpu:.0f} |")
    return [*lines, ""]


def write_report(
    out: str | Path,
    records: Sequence[dict],
    *,
    title: str = "rope-extend evaluation",
    notes: Sequence[str] = (),
    extra: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """Write results.json, results.csv, report.md and the plots into ``out``; return the paths by name."""
    out = Path(out)
    summary = summarize(records)
    files = {
        "json": write_json(out / "results.json", {**(extra or {}), "summary": summary, "records": list(records)}),
        "csv": write_csv(out / "results.csv", records),
        "markdown": write_text(out / "report.md", markdown(summary, title, notes) + "\n".join(time_table(records))),
    }
    from .tasks.base import tasks

    for task in tasks():
        files.update(task.plot(summary, out))
    return files
