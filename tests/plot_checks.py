"""Checks shared by the plot tests: every series has its own (colour, marker), and no legend covers an axes."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from matplotlib.colors import to_hex
from matplotlib.container import Container


def lines(ax) -> dict:
    """The data line behind each legend entry of ``ax`` (an errorbar's entry is a container: its first line)."""
    handles, labels = ax.get_legend_handles_labels()
    return {
        label: handle[0] if isinstance(handle, Container) else handle
        for handle, label in zip(handles, labels, strict=True)
    }


def series(ax) -> list[tuple[str, str, str]]:
    """(label, colour, marker) of every legend entry of ``ax`` (a scatter: its first face colour, marker "scatter")."""
    out = []
    for label, line in lines(ax).items():
        if hasattr(line, "get_marker"):
            out.append((label, to_hex(line.get_color()), str(line.get_marker())))
        else:
            out.append((label, to_hex(line.get_facecolor()[0]), "scatter"))
    return out


def assert_distinct(ax) -> None:
    pairs = [(colour, marker) for _, colour, marker in series(ax)]
    assert len(pairs) == len(set(pairs)), f"shared (colour, marker): {series(ax)}"


def assert_legends_outside(fig) -> None:
    """Each legend's box lies clear of every axes' data area (in display pixels, after drawing)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)
    assert legends, "no legend"
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            area = ax.get_window_extent(renderer)
            assert not box.overlaps(area), f"legend {box} over the axes {area}"
