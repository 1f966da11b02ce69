"""A method declares the form engines serve it in (``Method.engine_form``): a new method reaches every engine that
takes its form with no line in ``export/forms.py``, and one that declares none is refused as unknown."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from rope_extend.export import forms, routes
from rope_extend.methods import registry
from rope_extend.methods.linear import METHOD as LINEAR

# a copy of linear under a new name and rope type: the engines' linear serves it exactly
TOY = dataclasses.replace(LINEAR, name="toy_linear_form", rope_type="toy_linear_form")


@pytest.fixture
def toy():
    registry.METHODS.register(TOY)
    yield TOY
    registry.METHODS.unregister(TOY.name)


def _scaling(method, factor=4.0):
    return registry.resolve(method, factor=factor, original_max_position_embeddings=4096, params={})


def test_a_new_method_with_a_form_is_exported_like_the_one_it_copies(toy):
    form = forms.static_form(_scaling(toy), 64, 10000.0)
    assert form == forms.static_form(_scaling(LINEAR), 64, 10000.0)
    assert form.kind == forms.LINEAR and form.factor == 4.0 and form.original_max_position_embeddings == 4096
    for target in routes.TARGETS:
        assert routes.decide(_scaling(toy), target, 64, 10000.0).status == routes.EXPORTED, target


def test_a_method_without_a_form_is_refused_by_every_engine(toy):
    bare = dataclasses.replace(TOY, name="toy_no_form", rope_type="toy_no_form", engine_form=None)
    registry.METHODS.register(bare)
    try:
        assert forms.static_form(_scaling(bare), 64, 10000.0) is None
        for target in routes.TARGETS:
            decision = routes.decide(_scaling(bare), target, 64, 10000.0)
            assert decision.status == routes.REFUSED and decision.reason == "no engine knows this method", target
    finally:
        registry.METHODS.unregister(bare.name)


def test_forms_names_no_method():
    """No function of ``export/forms.py`` holds a method's name (``static_form`` used to switch on them)."""
    tree = ast.parse(Path(forms.__file__).read_text(encoding="utf-8"))
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    assert {f.name for f in functions} >= {"static_form", "patched_length"}
    strings = {n.value for f in functions for n in ast.walk(f) if isinstance(n, ast.Constant)}
    assert strings & set(registry.names()) == set()
