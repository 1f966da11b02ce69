"""The search's report: the factor curve against PI, NTK and YaRN, and the fitness over the search
(``search.png``), with a markdown summary (``report.md``). Written atomically."""

from __future__ import annotations

from pathlib import Path

from ..io import atomic_path, write_text

WHAT = {  # the fitness kinds (``needles.FITNESSES``), as the report names them
    "text": "perplexity of the search texts",
    "needle": "perplexity of the needles' answer tokens (passkey and RULER key-value, several depths)",
    "needle-multiquery": "perplexity of the needles' answer tokens (one RULER niah_multiquery document, five "
    "key-value needles)",
}


def write_report(result, curves: dict[str, list[float]], out: str | Path, *, title: str = "") -> list[Path]:
    """``result``: a ``SearchResult``; ``curves``: the seed methods' factors by name, for the plot."""
    out = Path(out)
    s, L = result.factor, result.original_length
    fig = search_figure(result, curves, title=title)
    with atomic_path(out / "search.png") as tmp:
        fig.savefig(tmp, dpi=110, format="png", bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    lines = [
        f"# LongRoPE search x{s:g} (target {round(s * L)} tokens, trained {L})",
        "",
        f"{result.evaluations} evaluations; fitness = {WHAT[result.objective]} at the target length.",
        "",
        *([_critical(result.critical), ""] if result.critical is not None else []),
        "| factors | fitness |",
        "|---|---:|",
        *[f"| {name} x{s:g} (seed) | {fit:.4f} |" for name, fit in result.seeds.items()],
        f"| searched | {result.fitness:.4f} |",
        "",
        "long_factor: " + ", ".join(f"{x:.2f}" for x in result.long_factor),
        "",
        "![factors and fitness](search.png)",
        "",
    ]
    return [out / "search.png", write_text(out / "report.md", "\n".join(lines))]


def _critical(critical: int) -> str:
    return (
        f"Critical dimension (LongRoPE2): {critical} of the rotary dimensions (frequency pair {critical // 2}), the "
        "first whose period the trained length did not cover."
    )


def search_figure(result, curves: dict[str, list[float]], *, title: str = ""):
    """The factors (top: each seed method and the searched curve, which is drawn thick and faint beneath the
    seeds so that a seed it follows, often YaRN, stays visible on top) and the fitness over the search
    (bottom), each panel with its legend outside, to its right."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    from ..plotting import legend_outside, styles

    s, L = result.factor, result.original_length
    fig, (left, right) = plt.subplots(2, 1, figsize=(8, 7.5))
    idx = list(range(len(result.long_factor)))
    look = styles(list(curves))
    every = max(len(curves) + 1, len(idx) // 8)
    left.plot(idx, result.long_factor, label="searched", color="black", lw=3.5, alpha=0.35, zorder=1)
    for k, (name, curve) in enumerate(curves.items()):
        left.plot(idx, curve, label=f"{name} x{s:g}", lw=1.2, markersize=4, markevery=(k % every, every), **look[name])
    left.set(xlabel="frequency pair i (high -> low frequency)", ylabel="rescale factor lambda_i", title="factors")
    legend_outside(left)
    steps = [h[0] for h in result.history]
    right.scatter(steps, [h[1] for h in result.history], s=6, color="0.6", label="candidate")
    right.plot(steps, [h[2] for h in result.history], color="black", label="best so far")
    seeds = styles(list(result.seeds))
    for name, fit in result.seeds.items():
        right.axhline(fit, ls="--", lw=0.8, label=f"{name} {fit:.3f}", color=seeds[name]["color"])
    best = min(h[2] for h in result.history)
    top = max(result.seeds.get("ntk", best), result.seeds.get("yarn", best), best) * 1.15
    right.set(
        xlabel="evaluation",
        ylabel=f"{result.objective} perplexity at {round(s * L)} tokens",
        title="fitness",
        ylim=(best * 0.97, top),
    )
    legend_outside(right)
    fig.suptitle(title or f"LongRoPE search x{s:g}")
    fig.tight_layout()
    return fig
