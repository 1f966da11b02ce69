"""Reports for people and machines: results JSON (summary + every record), CSV of records, a markdown
table, and PNG plots (passkey accuracy vs length, depth x length heatmaps, perplexity vs length, the
rotary spectrum). Every file is written atomically (``rope_extend.io.atomic_path``)."""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
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


def _proportion(xs: Sequence[float]) -> dict:
    """accuracy, trials, correct (a count for 0/1 outcomes) and the 95% Wilson interval ``low``..``high``."""
    total = float(sum(xs))
    low, high = wilson(total, len(xs))
    correct = int(total) if total == int(total) else round(total, 3)
    return {"accuracy": total / len(xs), "trials": len(xs), "correct": correct, "low": low, "high": high}


def _length_name(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


def summarize(records: Iterable[dict]) -> dict[str, list[dict]]:
    """Per task, one row per (run, length) (and per depth for heatmaps), in first-seen run order."""
    acc: dict = defaultdict(list)
    cell: dict = defaultdict(list)
    ppl: dict = defaultdict(lambda: [0.0, 0, 0])
    ruler: dict = defaultdict(list)
    for r in records:
        task, label = r.get("task"), label_of(r)
        if task == "ruler":
            ruler[(label, r["ruler_task"], r["length"])].append(float(r["score"]))
        elif task in ("passkey", "niah"):
            acc[(task, label, r["length"])].append(bool(r["correct"]))
            if r.get("depth_grid") is not None:
                cell[(task, label, r["length"], r["depth_grid"])].append(bool(r["correct"]))
        elif task == "perplexity":
            row = ppl[(label, r["length"])]
            row[0] += r["nll"]
            row[1] += r["tokens"]
            row[2] += 1
    out: dict[str, list[dict]] = defaultdict(list)
    for (task, label, length), xs in acc.items():
        out[task].append({"label": label, "length": length, **_proportion(xs)})
    for (task, label, length, depth), xs in cell.items():
        out[f"{task}_depth"].append({"label": label, "length": length, "depth": depth, **_proportion(xs)})
    for (label, length), (nll, tokens, docs) in ppl.items():
        out["perplexity"].append(
            {
                "label": label,
                "length": length,
                "perplexity": math.exp(nll / tokens) if tokens else None,
                "tokens": tokens,
                "docs": docs,
            }
        )
    tasks: dict = defaultdict(list)  # (label, length) -> task accuracies, for the average
    for (label, name, length), xs in ruler.items():
        cell_ = _proportion(xs)
        out["ruler"].append({"label": label, "task": name, "length": length, **cell_, "samples": cell_["trials"]})
        tasks[(label, length)].append(sum(xs) / len(xs))
    for (label, length), accs in tasks.items():
        out["ruler"].append(
            {"label": label, "task": "average", "length": length, "accuracy": sum(accs) / len(accs), "tasks": len(accs)}
        )
    return dict(out)


def ruler_markdown(rows: Sequence[dict]) -> list[str]:
    """Per run, a task x length table of RULER accuracy (string_match_all, %) with the average over tasks."""
    lines = ["## RULER synthetic tasks (string_match_all accuracy)", ""]
    lengths = sorted({r["length"] for r in rows})
    labels = _labels(rows)
    if len(labels) > 1:  # the runs side by side: the average over tasks per length
        mean = {(r["label"], r["length"]): r["accuracy"] for r in rows if r["task"] == "average"}
        lines += [
            "Average over tasks:",
            "",
            "| length | " + " | ".join(labels) + " |",
            "|---:|" + "---:|" * len(labels),
        ]
        for n in lengths:
            cells = [f"{100 * mean[(lb, n)]:.1f}" if (lb, n) in mean else "" for lb in labels]
            lines.append(f"| {_length_name(n)} | " + " | ".join(cells) + " |")
        lines.append("")
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        table = {(r["task"], r["length"]): r for r in mine}
        tasks = [t for t in dict.fromkeys(r["task"] for r in mine) if t != "average"]
        lines += [f"### {label}", "", "Each cell: mean score (samples; 95% Wilson interval, %).", ""]
        lines += ["| task | " + " | ".join(_length_name(n) for n in lengths) + " |"]
        lines.append("|---|" + "---:|" * len(lengths))
        for task in [*tasks, "average"]:
            cells = []
            for n in lengths:
                r = table.get((task, n))
                if r and task == "average":
                    note = f" ({r['tasks']} tasks)" if r["tasks"] != len(tasks) else ""
                elif r and "low" in r:
                    note = f" (n={r['trials']}; {100 * r['low']:.0f}-{100 * r['high']:.0f})"
                else:
                    note = ""
                cells.append(f"{100 * r['accuracy']:.1f}{note}" if r else "")
            name = f"**{task}**" if task == "average" else task
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _labels(rows: Sequence[dict]) -> list[str]:
    return list(dict.fromkeys(r["label"] for r in rows))


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


def markdown(summary: dict[str, list[dict]], title: str = "Results", notes: Sequence[str] = ()) -> str:
    """One table per task: a row per length, a column per run."""
    lines = [f"# {title}", ""] + [f"{n}  " for n in notes] + ([""] if notes else [])
    specs = [
        ("passkey", "Passkey retrieval accuracy", "accuracy"),
        ("niah", "Needle in a haystack accuracy", "accuracy"),
        ("perplexity", "Perplexity (token-weighted; lower is better)", "perplexity"),
    ]
    for task, heading, key in specs:
        rows = summary.get(task)
        if not rows:
            continue
        labels = _labels(rows)
        table = {(r["label"], r["length"]): r for r in rows}
        fmt = accuracy_cell if key == "accuracy" else perplexity_cell
        lines += [f"## {heading}", ""]
        if key == "accuracy":
            lines += ["Each cell: accuracy (correct/trials; 95% Wilson interval, %).", ""]
        lines += ["| length | " + " | ".join(labels) + " |", "|---:|" + "---:|" * len(labels)]
        for length in sorted({r["length"] for r in rows}):
            cells = [fmt(table[(lb, length)]) if (lb, length) in table else "" for lb in labels]
            lines.append(f"| {_length_name(length)} | " + " | ".join(cells) + " |")
        if task == "passkey":
            ctx = [passkey_context(rows, lb) for lb in labels]
            lines.append("| context (>= 80%) | " + " | ".join(_length_name(c) if c else "-" for c in ctx) + " |")
        lines.append("")
    if summary.get("ruler"):
        lines += ruler_markdown(summary["ruler"])
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
    ax.set_xticklabels([_length_name(n) for n in lengths])
    ax.minorticks_off()


def plot_lines(
    rows: Sequence[dict], key: str, path: str | Path, *, title: str, ylabel: str, log_y: bool = False
) -> Path:
    """``key`` vs length, one line per run (accuracy or perplexity). Each run has its own colour, marker and
    dash; accuracy points carry their 95% Wilson interval as error bars, and runs are nudged apart along the
    length axis (a few percent, log scale) so that equal values (several runs at 100%) stay visible."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    lengths = sorted({r["length"] for r in rows})
    labels = _labels(rows)
    colours = plt.get_cmap("tab10").colors
    for k, label in enumerate(labels):
        mine = sorted((r for r in rows if r["label"] == label and r[key] is not None), key=lambda r: r["length"])
        nudge = 2 ** (0.04 * (k - (len(labels) - 1) / 2)) if key == "accuracy" and len(labels) > 1 else 1.0
        xs = [r["length"] * nudge for r in mine]
        style = {
            "color": colours[k % len(colours)],
            "marker": "osD^v<>p*h"[k % 10],
            "linestyle": ["-", "--", "-.", ":"][(k // 10 + k) % 4],
            "markersize": 6,
            "alpha": 0.9,
            "label": label,
        }
        if key == "accuracy":
            ys = [100 * r["accuracy"] for r in mine]
            if all("low" in r for r in mine):
                below = [100 * (r["accuracy"] - r["low"]) for r in mine]
                above = [100 * (r["high"] - r["accuracy"]) for r in mine]
                ax.errorbar(xs, ys, yerr=[below, above], capsize=2.5, elinewidth=0.9, **style)
            else:
                ax.plot(xs, ys, **style)
        else:
            ax.plot(xs, [r[key] for r in mine], **style)
    _length_axis(ax, lengths)
    if log_y:
        from matplotlib.ticker import FuncFormatter, LogLocator

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_locator(LogLocator(subs=(2, 5)))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    if key == "accuracy":
        ax.set_ylim(-5, 105)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    # outside the axes, so that it never covers a point
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    if key == "accuracy":
        ax.text(1.01, 0.0, "bars: 95% Wilson interval", transform=ax.transAxes, fontsize=7, va="bottom")
    return _save(fig, path)


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
    ax.set_xticks(range(len(lengths)), [_length_name(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [row_names(d) for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label="accuracy")
    return _save(fig, path)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


FILES = ("records.jsonl", "results.json", "results.csv", "report.md", "suite.yaml")


def owned(name: str) -> bool:
    """Whether ``name`` is a file an evaluation writes into its output folder (records, reports, plots)."""
    return name in FILES or name.endswith(".png")


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
        "markdown": write_text(out / "report.md", markdown(summary, title, notes)),
    }
    if summary.get("passkey"):
        files["passkey_plot"] = plot_lines(
            summary["passkey"], "accuracy", out / "passkey.png", title="Passkey retrieval", ylabel="accuracy (%)"
        )
    if summary.get("perplexity"):
        files["perplexity_plot"] = plot_lines(
            summary["perplexity"],
            "perplexity",
            out / "perplexity.png",
            title="Perplexity vs context length",
            ylabel="perplexity (log)",
            log_y=True,
        )
    ruler = summary.get("ruler", [])
    for label in _labels(ruler):
        name = f"ruler_heatmap_{_slug(label)}"
        files[name] = plot_heatmap(
            [r for r in ruler if r["label"] == label],
            out / f"{name}.png",
            title=f"RULER: {label}",
            row_key="task",
            row_names=str,
            ylabel="task",
            order=lambda names: [t for t in names if t != "average"] + ["average"],
        )
    for task in ("passkey", "niah"):
        rows = summary.get(f"{task}_depth", [])
        for label in _labels(rows):
            name = f"{task}_heatmap_{_slug(label)}"
            files[name] = plot_heatmap(
                [r for r in rows if r["label"] == label],
                out / f"{name}.png",
                title=f"{'Passkey' if task == 'passkey' else 'Needle'} retrieval: {label}",
            )
    return files
