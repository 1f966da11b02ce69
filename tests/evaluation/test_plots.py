"""Every evaluation plot reads at a glance with twelve methods: no two series share (colour, marker), the legend
lies outside the axes, and an outlier does not flatten the perplexity plot (issue 55, item 3)."""

import math

import pytest

from rope_extend.evaluation.report import line_figure, plot_lines, robust_top, wilson
from rope_extend.evaluation.spectrum import plot_spectrum, spectrum, spectrum_figure
from rope_extend.methods import registry
from tests.plot_checks import assert_distinct, assert_legends_outside, lines, series

LENGTHS = (256, 512, 1024, 2048)
NAMES = ["none", "linear x4", "ntk x4", "dynamic x4", "ntk_by_parts x4", "yarn x4", "dynamic_yarn x4",
         "llama3 x4", "self_extend x4", "rerope x4", "string x4", "yarn x2"]  # fmt: skip


def _perplexity_rows():
    rows = []
    for k, name in enumerate(NAMES):
        for j, n in enumerate(LENGTHS):
            value = 200.0 - 10 * j if name == "linear x4" else 2.2 + 0.1 * k + 0.05 * j  # 2.2-3.45 and ~200
            rows.append({"label": name, "length": n, "perplexity": value})
    return rows


def _passkey_rows(trials=20):
    rows = []
    for name in NAMES:
        for n in LENGTHS:
            correct = trials if n <= 1024 else trials // 2  # seven-plus series stacked at 100%
            low, high = wilson(correct, trials)
            rows.append({"label": name, "length": n, "accuracy": correct / trials, "low": low, "high": high,
                         "correct": correct, "trials": trials})  # fmt: skip
    return rows


def _axis_fraction(ax, y):
    """Where ``y`` sits on the y axis, 0 at the bottom and 1 at the top (log or linear)."""
    return ax.transAxes.inverted().transform(ax.transData.transform((LENGTHS[0], y)))[1]


@pytest.mark.parametrize("log_y", [True, False])
def test_perplexity_plot_clips_an_outlier_and_keeps_the_rest_spread(log_y):
    fig, ax = line_figure(_perplexity_rows(), "perplexity", title="t", ylabel="ppl", log_y=log_y)
    assert len(series(ax)) == 12
    assert_distinct(ax)
    assert_legends_outside(fig)
    top = ax.get_ylim()[1]
    assert top < 10  # far below the 200 of linear x4
    others = [r["perplexity"] for r in _perplexity_rows() if r["label"] != "linear x4"]
    spread = _axis_fraction(ax, max(others)) - _axis_fraction(ax, min(others))
    assert spread > 0.6, spread  # the eleven others use most of the height, not a sliver at the bottom
    written = {t.get_text() for t in ax.texts}
    assert {"200", "190", "180", "170"} <= written  # each clipped point says its value


def test_perplexity_plot_without_an_outlier_is_not_clipped():
    rows = [r for r in _perplexity_rows() if r["label"] != "linear x4"]
    assert robust_top([r["perplexity"] for r in rows]) is None
    _, ax = line_figure(rows, "perplexity", title="t", ylabel="ppl", log_y=True)
    assert ax.get_ylim()[1] > max(r["perplexity"] for r in rows)
    assert not ax.texts


def test_robust_top_is_the_largest_value_near_the_median():
    assert robust_top([2.2, 2.5, 3.0, 3.5, 200.0, math.inf, math.nan]) == 3.5
    assert robust_top([]) is None


def test_passkey_plot_separates_series_stacked_at_100_percent():
    fig, ax = line_figure(_passkey_rows(), "accuracy", title="t", ylabel="accuracy (%)")
    assert_distinct(ax)
    assert_legends_outside(fig)
    assert len(series(ax)) == 12
    at_full = {
        label: [x for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True) if y == 100]
        for label, line in lines(ax).items()
    }
    assert len(at_full) == 12
    xs = sorted(xs[0] for xs in at_full.values())  # the twelve points at 256 tokens and 100%
    assert len(set(xs)) == 12 and xs[-1] / xs[0] < 2**0.45  # side by side, less than half an octave wide


def test_plot_lines_writes_the_png(tmp_path):
    path = plot_lines(_perplexity_rows(), "perplexity", tmp_path / "p.png", title="t", ylabel="ppl", log_y=True)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_spectrum_plot_styles_every_method_apart():
    methods = [m for m in registry.names() if m != "longrope"]
    curves, skipped = spectrum(methods, factor=4, head_dim=64)
    assert not skipped
    names = list(curves)[:12]
    fig, ax = spectrum_figure({n: curves[n] for n in names}, factor=4, head_dim=64)
    assert len(series(ax)) == 12
    assert_distinct(ax)
    assert_legends_outside(fig)
    drawn = {label.split(" ")[0]: line for label, line in lines(ax).items()}
    # NTK-by-parts lies under YaRN: a different dash, and its marks fall on other points
    assert drawn["ntk_by_parts"].get_linestyle() != drawn["yarn"].get_linestyle()
    assert drawn["ntk_by_parts"].get_markevery() != drawn["yarn"].get_markevery()


def test_plot_spectrum_writes_the_png(tmp_path):
    curves, _ = spectrum(["yarn", "ntk_by_parts"], factor=4, head_dim=64)
    assert plot_spectrum(curves, tmp_path / "s.png", factor=4, head_dim=64).read_bytes()[:4] == b"\x89PNG"
