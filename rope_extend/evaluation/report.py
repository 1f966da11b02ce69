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
        out[task].append({"label": label, "length": length, "accuracy": sum(xs) / len(xs), "trials": len(xs)})
    for (task, label, length, depth), xs in cell.items():
        out[f"{task}_depth"].append(
            {"label": label, "length": length, "depth": depth, "accuracy": sum(xs) / len(xs), "trials": len(xs)}
        )
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
        out["ruler"].append(
            {"label": label, "task": name, "length": length, "accuracy": sum(xs) / len(xs), "samples": len(xs)}
        )
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
        lines += [f"### {label}", "", "| task | " + " | ".join(_length_name(n) for n in lengths) + " |"]
        lines.append("|---|" + "---:|" * len(lengths))
        for task in [*tasks, "average"]:
            cells = []
            for n in lengths:
                r = table.get((task, n))
                note = f" ({r['tasks']} tasks)" if r and task == "average" and r["tasks"] != len(tasks) else ""
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
        table = {(r["label"], r["length"]): r[key] for r in rows}
        fmt = (lambda v: f"{100 * v:.0f}%") if key == "accuracy" else (lambda v: f"{v:.3f}" if v < 1e4 else f"{v:.3g}")
        lines += [f"## {heading}", "", "| length | " + " | ".join(labels) + " |", "|---:|" + "---:|" * len(labels)]
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
    """``key`` vs length, one line per run (accuracy or perplexity)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    lengths = sorted({r["length"] for r in rows})
    for k, label in enumerate(_labels(rows)):
        pts = sorted((r["length"], r[key]) for r in rows if r["label"] == label and r[key] is not None)
        ys = [100 * y for _, y in pts] if key == "accuracy" else [y for _, y in pts]
        # distinct markers and dashes: runs with equal numbers still show up as separate lines
        ax.plot(
            [x for x, _ in pts],
            ys,
            marker="osD^v<>p"[k % 8],
            linestyle=["-", "--", "-.", ":"][k % 4],
            markersize=7 - min(k, 4),
            alpha=0.85,
            label=label,
        )
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
    ax.legend(fontsize=8)
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
    for r in rows:
        grid[depths.index(r[row_key])][lengths.index(r["length"])] = r["accuracy"]
    fig, ax = plt.subplots(figsize=(1.0 + 0.7 * len(lengths), 1.0 + 0.45 * len(depths)))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if grid[i][j] == grid[i][j]:
                ax.text(j, i, f"{100 * grid[i][j]:.0f}%", ha="center", va="center", fontsize=8)
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
