"""What every plot shares so that it reads at a glance with many methods: one style per series (a colour, a
marker and a dash of its own, the same method drawn the same way in every plot) and a legend outside the axes.

Twenty colours (tab20, the dark half first) and twenty markers, both taken at the series' index ``k``, so the
first twenty series differ in colour AND marker; past twenty the marker moves on by one per round of colours,
so a (colour, marker) pair never repeats before 400 series. A method of the registry (``yarn``, ``yarn x4``,
``yarn x4 (config)``) takes its fixed index when no earlier series of the same plot holds it, so that yarn has
one look in the perplexity, passkey and spectrum plots alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# tab20's dark shades (even indices) then its light ones: neighbours in the list never share a hue pair
_TAB20 = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5",
)  # fmt: skip
MARKERS = ("o", "s", "D", "^", "v", "<", ">", "p", "*", "h", "X", "P", "d", "8", "H", "1", "2", "3", "4", "+")
DASHES = ("-", "--", "-.", ":")

# the registry's methods (and the baselines) in a fixed order: each keeps its style from plot to plot
METHODS = (
    "none",
    "linear",
    "ntk",
    "dynamic",
    "ntk_by_parts",
    "yarn",
    "dynamic_yarn",
    "llama3",
    "longrope",
    "self_extend",
    "dual_chunk",
    "rerope",
    "leaky_rerope",
    "string",
    "searched",
)


def style(k: int) -> dict[str, Any]:
    """The ``k``-th style: ``color``, ``marker`` and ``linestyle`` (pairs of colour and marker are unique for
    k < 400, see the module docstring)."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    n = len(_TAB20)
    return {
        "color": _TAB20[k % n],
        "marker": MARKERS[(k + k // n) % len(MARKERS)],
        "linestyle": DASHES[(k + k // len(DASHES)) % len(DASHES)],
    }


def _method(name: str) -> str:
    return name.split(" ", 1)[0]


def styles(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """A distinct style per name (a name repeated is styled once): a registry method's own index when no earlier
    name holds it, else the first free index past the registry's (``yarn x2`` then ``yarn x4``: the second
    gets a style of its own)."""
    taken: set[int] = set()
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(names):
        method = name.split(" ", 1)[0]
        k = METHODS.index(method) if method in METHODS else -1
        if k < 0 or k in taken:
            k = next(i for i in range(len(METHODS), len(METHODS) + len(taken) + 1) if i not in taken)
        taken.add(k)
        out[name] = style(k)
    return out


def legend_outside(ax, **kwargs):
    """The legend to the right of ``ax``, top-aligned, so that it never covers a point (the figure is saved
    with ``bbox_inches="tight"``, which widens it to hold the legend)."""
    options = {"fontsize": 8, "loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0}
    return ax.legend(**{**options, **kwargs})
