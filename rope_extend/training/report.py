"""The loss curve: CSV for machines, PNG for people, both written atomically."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from ..io import atomic_path, write_text


def smoothed(values: list[float], window: int | None = None) -> list[float]:
    """Centred moving mean over ``window`` points (default: a tenth of the points, odd, at least 3); the ends
    average what they have."""
    n = len(values)
    window = window or max(3, (n // 10) | 1)
    half = window // 2
    out = []
    for i in range(n):
        part = values[max(0, i - half) : i + half + 1]
        out.append(sum(part) / len(part))
    return out


def write_loss_curve(history: list[dict], out: str | Path) -> None:
    if not history:
        return
    out = Path(out)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(history[0]))
    writer.writeheader()
    writer.writerows(history)
    write_text(out / "loss.csv", buf.getvalue())

    fig = loss_figure(history, out.name)
    with atomic_path(out / "loss.png") as tmp:
        fig.savefig(tmp, format="png", bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)


def loss_figure(history: list[dict], name: str):
    """The loss (points and their moving mean, left axis) and the learning rate (dashed, right axis) over the
    optimizer steps; one legend for both axes, outside them, so that it covers neither curve."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    steps, losses = [r["step"] for r in history], [r["loss"] for r in history]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, losses, "o", color="tab:blue", alpha=0.35, ms=3, label="loss (mean over each logging interval)")
    if len(losses) >= 5:
        ax.plot(steps, smoothed(losses), lw=2, color="tab:blue", label="smoothed (moving mean)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("token cross-entropy (nats)")
    ax.set_title(f"{name}: loss over {steps[-1]} steps")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    rates = [r["learning_rate"] for r in history]
    ax2.plot(steps, rates, color="tab:gray", lw=1, ls="--", marker="s", ms=2, label="learning rate")
    ax2.set_ylabel("learning rate", color="tab:gray")
    # below both axes (the right one holds the learning rate's ticks): one legend for the lines of both
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8, frameon=False)
    return fig
