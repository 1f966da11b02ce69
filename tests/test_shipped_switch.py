"""A model that ships transformers' own ``longrope`` (``rope_extend.shipped_switch``): transformers switches its factors at
``L`` without turning the cached keys, so cached generation that crosses ``L`` parts from uncached generation;
with rope-extend's ``longrope`` in its place (the harness's ``method: none``) the two agree, and the rope is the
shipped one on both sides of the switch."""

from __future__ import annotations

import pytest
import torch

import rope_extend
from rope_extend import UnsupportedModelError
from rope_extend.patching import patched
from rope_extend.scaling import ScalingRequest
from rope_extend.shipped_switch import exact_shipped_switch
from tests.test_phi3_generate import TOLERANCE, cached_and_uncached, gap, longrope_factors, prompt
from tests.tiny import tiny_model

L = 32


def shipped(layers: int = 2, **params):
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": L,
            **longrope_factors(), **params}  # fmt: skip
    return tiny_model("llama", max_position_embeddings=4 * L, rope_parameters=rope, num_hidden_layers=layers)


@pytest.mark.parametrize("attention_factor", [None, 1.0])
def test_cached_generation_across_L_matches_uncached_with_the_shipped_rope(attention_factor):
    # one layer: its cached keys come from the embeddings, so turning them gives what the uncached forward computes
    # exactly (deeper, the prompt's hidden states keep the short factors: the frozen reference, docs/serving.md)
    model = shipped(1, **({} if attention_factor is None else {"attention_factor": attention_factor}))
    ids = prompt(L)  # the prompt ends at L: the first new token from the short factors, the rest past the switch
    with torch.no_grad():
        before = model(prompt(L + 8)).logits  # uncached, one forward past L: the long factors throughout
    cached, uncached = cached_and_uncached(model, ids)
    assert gap(cached, uncached) > 100 * TOLERANCE  # transformers' own: cached keys keep the short factors' angles
    said = exact_shipped_switch(model)
    assert said is not None and "turns cached keys" in said and patched(model) is not None
    with torch.no_grad():
        assert torch.allclose(model(prompt(L + 8)).logits, before, rtol=0, atol=TOLERANCE)  # the same rope
    cached, again = cached_and_uncached(model, ids)
    assert gap(cached, again) < TOLERANCE  # keys turned at the switch
    assert gap(again, uncached) < TOLERANCE  # and uncached generation is what it was


def test_a_model_that_ships_no_switching_rope_is_left_alone():
    model = tiny_model("llama")
    assert exact_shipped_switch(model) is None and patched(model) is None
    rope_extend.patch(model, "yarn", factor=2)  # a patched model: its patch stays
    assert exact_shipped_switch(model) is None and patched(model).method.name == "yarn"
    model = tiny_model("llama", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0})
    assert exact_shipped_switch(model) is None and patched(model) is None


def test_method_none_runs_a_shipped_longrope_with_turned_keys(capsys, caplog):
    model = shipped(attention_factor=1.0)
    ScalingRequest(method="none").apply(model)
    assert patched(model) is not None and patched(model).method.name == "longrope"
    assert "rope-extend: the model ships transformers' longrope" in capsys.readouterr().err
    assert not [r for r in caplog.records if "replaces it" in r.getMessage()]  # patch's line would say otherwise
    rope_extend.unpatch(model)
    rope_extend.patch(model, "longrope", factor=4.0, **longrope_factors())  # a user's own patch still says it
    assert [r for r in caplog.records if "replaces it" in r.getMessage()]


def test_a_rope_it_cannot_reproduce_is_refused_and_left_as_shipped(monkeypatch):
    from rope_extend import shipped_switch

    model = shipped()
    real = shipped_switch._rotary
    calls = []

    def off(m, n):  # the second pair of reads (patched) is off by a little
        calls.append(n)
        out = real(m, n)
        return [(c + 1e-4, s) for c, s in out] if len(calls) > 2 else out

    monkeypatch.setattr(shipped_switch, "_rotary", off)
    with pytest.raises(UnsupportedModelError, match=r"does not reproduce its rope at 32 positions"):
        exact_shipped_switch(model)
    assert patched(model) is None


def test_records_name_the_config_scaling_as_before_and_a_later_patch_as_a_patch():
    from rope_extend.evaluation.records import run_info

    model = shipped(attention_factor=1.0)
    before = run_info(model)
    assert before["scaling_from"] == "config" and before["method"] == "longrope"
    assert exact_shipped_switch(model) is not None
    assert run_info(model) == before  # the same scaling, the same identity: records measured before stay valid
    rope_extend.patch(model, "yarn", factor=2)
    assert "scaling_from" not in run_info(model) and run_info(model)["method"] == "yarn"
    rope_extend.unpatch(model)
    assert run_info(model) == before
