"""rope_extend.hf.families: the ordered registry of family rules, and the answers of the built-in ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rope_extend import RopeExtendError
from rope_extend.hf import families
from rope_extend.hf.families import RULES, Rule, ask, constant


@pytest.fixture
def registered():
    names = []

    def add(rule: Rule) -> Rule:
        RULES.register(rule)
        names.append(rule.name)
        return rule

    yield add
    for name in names:
        RULES.unregister(name)


def test_the_first_answer_that_is_not_none_wins_in_registration_order(registered):
    holder = SimpleNamespace(model_type="toy", attn_temperature_tuning=False)
    assert ask("own_temperature", holder) is None
    registered(Rule("toy_silent", "own_temperature", lambda h: None))
    registered(Rule("toy_first", "own_temperature", constant("first"), ("toy",)))
    registered(Rule("toy_second", "own_temperature", constant("second")))
    assert ask("own_temperature", holder) == "first"
    assert ask("own_temperature", SimpleNamespace(model_type="other")) == "second"  # toy_first is keyed by type
    assert ask("scale_keys", holder) is None  # another quirk's rules are not asked
    RULES.unregister("toy_first")
    assert ask("own_temperature", holder) == "second"
    registered(Rule("toy_first", "own_temperature", constant("first"), ("toy",)))  # for the teardown


def test_a_rule_for_an_unknown_quirk_and_a_misspelt_question_are_refused():
    with pytest.raises(RopeExtendError, match="quirk must be one of scale_keys, .*got 'scale_key'"):
        RULES.register(Rule("toy", "scale_key", constant(())))
    with pytest.raises(RopeExtendError, match="unknown family quirk 'scale_key'"):
        ask("scale_key", SimpleNamespace())
    with pytest.raises(RopeExtendError, match="a family rule named 'phimoe_scale_keys' is already registered"):
        RULES.register(Rule("phimoe_scale_keys", "scale_keys", constant(())))
    assert "toy" not in RULES


def test_the_built_in_rules_answer_for_their_families_only():
    phimoe, llama = SimpleNamespace(model_type="phimoe"), SimpleNamespace(model_type="llama")
    assert ask("scale_keys", phimoe) == ("short_mscale", "long_mscale") and ask("scale_keys", llama) is None
    assert ask("linear_within_context", SimpleNamespace(model_type="gemma3_text")) is True
    assert ask("linear_within_context", SimpleNamespace(model_type="llama")) is None
    assert families.model_types_for("longrope_only") == ["phi3", "phi4_multimodal"]
    assert "(32) tokens" in ask(
        "generate_swaps_cache", SimpleNamespace(model_type="phimoe", original_max_position_embeddings=32)
    )
    assert ask("generate_swaps_cache", SimpleNamespace(model_type="phi3")) is None  # no switch, no swap
    assert ask("generate_swaps_cache", SimpleNamespace(model_type="llama", original_max_position_embeddings=32)) is None
    tuned = SimpleNamespace(attn_temperature_tuning=True, attn_scale=0.1, floor_scale=8192)
    assert "1 + 0.1 ln(1 + floor((p + 1) / 8192))" in ask("own_temperature", tuned)
    assert ask("own_temperature", SimpleNamespace(attn_temperature_tuning=False)) is None
    beta = {"rope_type": "yarn", "llama_4_scaling_beta": 0.1}
    assert "llama_4_scaling_beta" in ask("kept_reads", llama, beta)
    assert "short_mscale and long_mscale" in ask("kept_reads", phimoe, beta)  # the first rule in order answers
    assert ask("kept_reads", llama, {"rope_type": "yarn"}) is None


def test_the_state_layers_are_the_layer_types_whose_cache_keeps_a_state():
    """A capability rule (no family named): the layer types that transformers' own DynamicCache(config=...) gives a
    recurrent or convolution state (``LinearAttentionCacheLayerMixin``), read from ``layer_types``; not the
    feed-forward layers that transformers 5.17 gives an empty LinearAttentionLayer as a placeholder."""
    from rope_extend.hf.families import recurrent

    types = ["conv", "conv", "full_attention", "linear_attention", "sliding_attention", "hybrid", "moe", "mlp"]
    assert ask("state_layers", SimpleNamespace(layer_types=types)) == {
        0: "conv",
        1: "conv",
        3: "linear_attention",
        5: "hybrid",
    }
    assert ask("state_layers", SimpleNamespace(layer_types=["full_attention", "sliding_attention"])) is None
    assert ask("state_layers", SimpleNamespace(layer_types=None)) is None
    assert ask("state_layers", SimpleNamespace()) is None
    assert (
        recurrent.describe({0: "conv", 1: "conv", 3: "linear_attention"})
        == "layers 0, 1 (conv) and 3 (linear_attention)"
    )
    assert recurrent.describe({i: "linear_attention" for i in (0, 1, 2, 4, 5, 6, 9)}) == (
        "layers 0-2, 4-6, 9 (linear_attention)"
    )
    assert recurrent.describe({7: "hybrid"}) == "layer 7 (hybrid)"
