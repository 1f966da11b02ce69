from types import SimpleNamespace

from rope_extend.factor_search.report import search_figure, write_report
from tests.plot_checks import assert_distinct, assert_legends_outside, lines, series

NAMES = ["linear", "ntk", "yarn", "ntk_by_parts", "llama3", "dynamic", "dynamic_yarn", "string", "rerope",
         "self_extend", "dual_chunk", "leaky_rerope"]  # fmt: skip


def _result():
    history = [(i, 3.0 - 0.01 * i + 0.05 * (i % 4), 3.0 - 0.01 * i) for i in range(50)]
    seeds = {name: 2.6 + 0.02 * k for k, name in enumerate(NAMES)}
    return SimpleNamespace(factor=4.0, original_length=1024, long_factor=[1 + 3 * i / 31 for i in range(32)],
                           history=history, seeds=seeds, evaluations=50, fitness=2.5, objective="text",
                           critical=None)  # fmt: skip


def test_search_plot_keeps_yarn_visible_over_the_searched_curve_and_legends_outside():
    result = _result()
    curves = {name: list(result.long_factor) for name in NAMES}  # every seed on the searched curve
    fig = search_figure(result, curves)
    factors, fitness = fig.axes
    assert len(series(factors)) == 13
    assert_distinct(factors)
    assert_distinct(fitness)
    assert_legends_outside(fig)
    drawn = lines(factors)
    assert drawn["yarn x4"].get_zorder() > drawn["searched"].get_zorder()  # the seed is drawn on top


def test_write_report_writes_the_png(tmp_path):
    result = _result()
    paths = write_report(result, {"yarn": list(result.long_factor)}, tmp_path)
    assert paths[0].read_bytes()[:4] == b"\x89PNG"
