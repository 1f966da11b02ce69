"""The method x engine decisions and the engine-neutral forms (pure numbers, no model)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_extend.errors import RopeExtendError
from rope_extend.export import configs, forms, routes
from rope_extend.hf.rotary import bucket
from rope_extend.methods import registry
from rope_extend.methods._common import rope_frequencies


def scaling(name, factor=4.0, length=4096, **params):
    method = registry.get(name)
    return registry.resolve(method, factor=factor, original_max_position_embeddings=length, params=params)


def test_table_covers_every_method_and_target():
    rows = dict(routes.table())
    assert set(rows) == {"none", *registry.names()}
    for row in rows.values():
        assert set(row) == set(routes.TARGETS)
    assert rows["yarn"] == dict.fromkeys(routes.TARGETS, routes.EXPORTED)
    assert rows["dynamic_yarn"]["vllm"] == routes.EXPORTED  # per request, by rope-extend's plugin (test_adaptive)
    assert rows["dynamic_yarn"]["sglang"] == routes.APPROXIMATE
    assert rows["self_extend"] == {
        "gguf": routes.APPROXIMATE,
        "vllm": routes.REFUSED,
        "sglang": routes.REFUSED,
        "transformers4": routes.REFUSED,
        "mlx": routes.REFUSED,
    }
    assert set(rows["rerope"].values()) == {routes.REFUSED}


@pytest.mark.parametrize("name", ["dual_chunk", "rerope", "leaky_rerope"])
def test_refusal_names_method_engine_and_nearest(name):
    decision = routes.decide(scaling(name), "vllm", 64, 10000.0)
    message = decision.message(name, "vllm")
    assert decision.status == routes.REFUSED
    assert name in message and "vllm 0.33.0" in message and "nearest that exports: yarn with factor 4" in message


def test_logn_is_refused_everywhere():
    s = scaling("yarn", logn=True)
    for target in routes.TARGETS:
        d = routes.decide(s, target, 64, 10000.0)
        assert d.status == routes.REFUSED and "yarn without logn" in d.nearest


def test_unknown_target():
    with pytest.raises(RopeExtendError, match="unknown export target 'vlm'.*did you mean 'vllm'"):
        routes.check_target("vlm")


def test_ntk_is_a_base_change_with_the_same_frequencies():
    s = scaling("ntk", factor=4.0)
    form = forms.static_form(s, 64, 10000.0)
    assert form.kind == forms.DEFAULT and form.attention_scale == 1.0
    torch.testing.assert_close(rope_frequencies(64, form.base), s.compute(64, 10000.0)[0], rtol=0, atol=0)


@settings(max_examples=40, deadline=None)
@given(factor=st.floats(1.0, 16.0), dim=st.sampled_from([16, 64, 128]))
def test_dynamic_made_static_equals_dynamic_at_the_target(factor, dim):
    """The patched model's frequencies for a sequence of the target's length: the method at the target rounded up
    to the patched model's re-rotation grid."""
    s = scaling("dynamic", factor=factor, length=2048)
    form = forms.static_form(s, dim, 10000.0)
    assert forms.patched_length(s) == bucket(s.target_length, 2048) >= s.target_length
    expected = s.compute(dim, 10000.0, forms.patched_length(s))[0]
    torch.testing.assert_close(rope_frequencies(dim, form.base), expected, rtol=2e-6, atol=0)
    assert form.changes


def test_dynamic_static_base_pinned_at_the_bundled_models_settings():
    """L = 256, T = 1024, d = 64, base 1600 (the bundled model): the patched model computes dynamic at 1052 tokens,
    the target rounded up to its grid, so alpha is 4 x 1052 / 256 - 3 = 13.4375, not 13 (the target itself)."""
    s = scaling("dynamic", factor=4.0, length=256)
    assert s.target_length == 1024 and forms.patched_length(s) == 1052
    form = forms.static_form(s, 64, 1600.0)
    assert form.base == pytest.approx(1600.0 * 13.4375 ** (64 / 62), rel=1e-12)
    assert form.base == pytest.approx(23379.5329, abs=1e-4)
    assert "base x 13.4375^(d/(d-2))" in form.changes and "at 1052" in form.changes


@settings(max_examples=40, deadline=None)
@given(factor=st.floats(1.01, 32.0), attention=st.one_of(st.none(), st.floats(0.5, 3.0)))
def test_yarn_attn_factor_times_yarn_temperature_is_the_scale(factor, attention):
    params = {} if attention is None else {"attention_factor": attention}
    form = forms.static_form(scaling("yarn", factor=factor, **params), 64, 10000.0)
    assert math.isclose(forms.yarn_attn_factor(form) * forms.mscale(factor), form.attention_scale, rel_tol=1e-12)
    if attention is None:
        assert forms.yarn_attn_factor(form) == 1.0


def test_ntk_by_parts_is_yarn_at_scale_one():
    form = forms.static_form(scaling("ntk_by_parts", factor=8.0), 64, 10000.0)
    assert form.kind == forms.YARN and form.attention_scale == 1.0
    assert math.isclose(forms.yarn_attn_factor(form), 1 / (0.1 * math.log(8) + 1))


def test_static_dynamic_yarn_says_what_the_patched_model_runs_at_the_target():
    form = forms.static_form(scaling("dynamic_yarn", factor=4.0, length=256), 64, 1600.0)
    assert form.kind == forms.YARN and form.factor == 4.0  # YaRN at the factor, the standard static form
    assert form.changes.endswith("runs YaRN at 4.109")  # 1052 / 256


def test_finetuned_dynamic_yarn_is_exact():
    s = scaling("dynamic_yarn", factor=4.0, finetuned=True)
    assert routes.decide(s, "vllm", 64, 10000.0).status == routes.EXPORTED
    assert routes.decide(scaling("dynamic_yarn"), "sglang", 64, 10000.0).status == routes.APPROXIMATE
    assert not routes.decide(s, "vllm", 64, 10000.0).adaptive


def test_readme_table_is_generated():
    from pathlib import Path

    root = Path(__file__).parents[2]
    for page in (root / "docs" / "serving.md", root / "README.md"):
        assert routes.markdown_table() in page.read_text(encoding="utf-8"), page


def test_config_keys_only_for_a_target_that_writes_a_config():
    """``configs.config_updates`` named a target without a config (gguf) failed with an AttributeError."""
    form = forms.static_form(scaling("yarn"), 128, 10000.0)
    assert configs.config_updates(form, 16384, "vllm")["rope_parameters"]["rope_type"] == "yarn"
    with pytest.raises(RopeExtendError, match=r"^export target 'gguf' writes a GGUF file.*not a config"):
        configs.config_updates(form, 16384, "gguf")


def test_a_refusal_has_no_form_to_serve():
    refused = routes.decide(scaling("rerope"), "vllm", 128, 10000.0)
    assert refused.status == routes.REFUSED and refused.form is None
    with pytest.raises(ValueError, match="'refused' export decision without a form"):
        _ = refused.served
    exported = routes.decide(scaling("yarn"), "vllm", 128, 10000.0)
    assert exported.served is exported.form and exported.served.original_length == 4096


@pytest.mark.parametrize(
    ("name", "reason", "nearest"),
    [
        ("dual_chunk", "it has no dual-chunk attention", "yarn with factor 4"),
        ("self_extend", "it has no Self-Extend (only llama.cpp has a version of it)", "--to gguf"),
        ("rerope", "it has no attention that changes positions per query and key", "yarn with factor 4"),
        ("leaky_rerope", "it has no attention that changes positions per query and key", "yarn with factor 4"),
    ],
)
def test_an_attention_method_is_refused_with_what_it_declares(name, reason, nearest):
    """The rules every engine shares read the refusal from the method (``Method.engine_lacks`` /
    ``engine_instead``), so transformers 4, which says nothing of its own about attention methods, gives each
    method's words."""
    factor = None if name == "self_extend" else 4.0
    decision = routes.decide(scaling(name, factor=factor), "transformers4", 64, 10000.0)
    assert (decision.status, decision.reason, decision.nearest) == (routes.REFUSED, reason, nearest)


def test_a_new_attention_method_needs_no_line_in_routes():
    import dataclasses

    toy = dataclasses.replace(registry.get("rerope"), name="toy", engine_lacks="it has no toy attention")
    scaled = registry.resolve(toy, factor=2.0, original_max_position_embeddings=4096, params={})
    decision = routes.decide(scaled, "transformers4", 64, 10000.0)
    assert (decision.status, decision.reason, decision.nearest) == (
        routes.REFUSED,
        "it has no toy attention",
        "yarn with factor 2",
    )
