from rope_extend.training.report import loss_figure, write_loss_curve
from tests.plot_checks import assert_distinct, assert_legends_outside, series


def _history(n=40):
    return [{"step": i + 1, "loss": 3.0 - i / n + 0.1 * (i % 3), "learning_rate": 1e-4 * min(1, (i + 1) / 5)}
            for i in range(n)]  # fmt: skip


def test_the_loss_plot_legend_covers_neither_curve():
    fig = loss_figure(_history(), "run")
    loss_axis, rate_axis = fig.axes
    assert [s[0] for s in series(loss_axis)] + [s[0] for s in series(rate_axis)] == [
        "loss (mean over each logging interval)",
        "smoothed (moving mean)",
        "learning rate",
    ]
    assert_distinct(loss_axis)
    assert_legends_outside(fig)  # clear of both the loss axes and the learning rate's twin


def test_write_loss_curve_writes_csv_and_png(tmp_path):
    write_loss_curve(_history(), tmp_path)
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "loss.csv").read_text().startswith("step,loss,learning_rate")
