import pytest

from rope_extend.methods import registry
from rope_extend.plotting import METHODS, style, styles


def test_four_hundred_styles_never_repeat_a_colour_and_marker():
    pairs = [(style(k)["color"], style(k)["marker"]) for k in range(400)]
    assert len(set(pairs)) == 400
    first = [style(k) for k in range(20)]  # the first twenty differ in colour and in marker alike
    assert len({s["color"] for s in first}) == 20 and len({s["marker"] for s in first}) == 20


def test_every_registry_method_has_a_fixed_style_in_every_plot():
    assert set(registry.names()) <= set(METHODS)
    alone = styles(["yarn x4"])["yarn x4"]
    among = styles(["none", "linear x4", "string", "yarn x4", "ntk x4"])["yarn x4"]
    assert alone == among == style(METHODS.index("yarn"))


def test_the_same_method_twice_gets_two_styles():
    looks = styles(["yarn x2", "yarn x4", "yarn x4", *[f"custom {i}" for i in range(30)]])
    assert len(looks) == 32
    assert len({(s["color"], s["marker"]) for s in looks.values()}) == 32


def test_a_negative_index_is_refused():
    with pytest.raises(ValueError, match="k must be >= 0"):
        style(-1)
