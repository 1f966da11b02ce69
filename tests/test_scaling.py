"""One scaling request (``ScalingRequest``): the suite, the recipe, the command line, lm-eval's model_args and
``patch`` accept and refuse the same requests, by the rules of ``methods.resolve``, each naming the key the
way its user wrote it."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_extend import RopeExtendError, lmeval
from rope_extend.arguments import add_method_arguments, scaling_from_args
from rope_extend.evaluation.suite import MethodSpec
from rope_extend.methods import registry
from rope_extend.scaling import ScalingRequest
from rope_extend.training.args import RecipeError, TrainArgs


def via_suite(method, factor=None, target_length=None, params=None):
    return MethodSpec(method=method, factor=factor, target_length=target_length, params=params or {})


def via_recipe(method, factor=None, target_length=None, params=None):
    args = TrainArgs()
    args.model.name_or_path, args.data.path = "some/model", "x.txt"
    args.rope.method, args.rope.factor, args.rope.target_length = method, factor, target_length
    args.rope.params = params or {}
    return args.validate().rope


def via_cli(method, factor=None, target_length=None, params=None):
    parser = argparse.ArgumentParser()
    add_method_arguments(parser)
    argv = ["--method", method] if method else []
    argv += ["--factor", str(factor)] if factor is not None else []
    argv += ["--target-length", str(target_length)] if target_length is not None else []
    for key, value in (params or {}).items():
        argv += ["--param", f"{key}={value}"]
    return scaling_from_args(parser.parse_args(argv))


def via_lmeval(method, factor=None, target_length=None, params=None):
    values = {"pretrained": "bundled", "method": method, "factor": factor, "target_length": target_length}
    return lmeval.split_arguments({**values, **(params or {})}).scaling


ENTRIES = {"suite": via_suite, "recipe": via_recipe, "cli": via_cli, "lmeval": via_lmeval}

CASES = [  # (method, factor, target_length, params), what a refusal says (None: accepted)
    (("yarn", 4, None, {}), None),
    (("yarn", None, 4096, {"beta_fast": 16}), None),
    (("self_extend", None, None, {"group_size": 4}), None),  # attention methods need no factor (training too)
    (("dual_chunk", None, None, {}), None),
    (("linear", 2, None, {"logn": True}), None),
    (("yarn", None, None, {}), "exactly one of"),
    (("yarn", 2, 4096, {}), "exactly one of"),
    (("yarn", 0.5, None, {}), "must be >= 1"),
    (("yran", 2, None, {}), "unknown method 'yran'.*did you mean 'yarn'"),
    (("yarn", 2, None, {"beta_fats": 3}), "beta_fats"),
    (("linear", 2, None, {"logn": 3}), "true or false"),
    (("none", 2, None, {}), "given without a scaling method"),
]


@pytest.mark.parametrize(("request_", "refusal"), CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_every_entry_accepts_and_refuses_the_same_requests(entry, request_, refusal):
    method, factor, target, params = request_
    if refusal is None:
        spec = ENTRIES[entry](method, factor, target, params)
        assert (spec.method, spec.factor, spec.target_length) == (method, factor, target)
        assert {k: v for k, v in spec.params.items()} == params
    else:
        with pytest.raises((RopeExtendError, RecipeError), match=refusal):
            ENTRIES[entry](method, factor, target, params)


@pytest.mark.parametrize(
    ("entry", "key"), [("suite", "factor"), ("recipe", "rope.factor"), ("cli", "--factor"), ("lmeval", "factor=")]
)
def test_each_entry_names_the_key_as_its_user_wrote_it(entry, key):
    with pytest.raises((RopeExtendError, RecipeError), match=f"^{key} must be >= 1"):
        ENTRIES[entry]("yarn", 0.5)
    with pytest.raises((RopeExtendError, RecipeError), match=f"{key} given without a scaling method"):
        ENTRIES[entry]("none", 2)


def test_the_spec_patches_what_it_says():
    import rope_extend
    from tests.tiny import tiny_model

    model = tiny_model()
    ScalingRequest("yarn", target_length=1024, params={"beta_fast": 16}).check().apply(model)
    scaling = rope_extend.patched(model)
    assert (scaling.method.name, scaling.factor, scaling.params.beta_fast) == ("yarn", 4.0, 16)
    ScalingRequest().apply(model)  # none: nothing happens
    assert rope_extend.patched(model) == scaling


NAMES = st.sampled_from(["yarn", "linear", "ntk", "dynamic", "dynamic_yarn", "llama3", "ntk_by_parts"])
AMOUNTS = st.one_of(st.none(), st.floats(0.25, 16, allow_nan=False), st.integers(-2, 16))


@settings(max_examples=200, deadline=None)
@given(method=NAMES, factor=AMOUNTS, target=st.one_of(st.none(), st.integers(-10, 10_000)))
def test_a_spec_passes_its_check_exactly_when_resolve_passes_with_a_short_enough_L(method, factor, target):
    """``check`` is ``resolve`` without the model: with ``L = 2``, the least ``L`` (``check_original_length``:
    LongRoPE and log-n divide by ``ln L``), every target length ``check`` accepts (>= 2) reaches ``L``, and the
    frequency methods have no parameter bounded by ``L``, so the two agree on every request. (The attention
    methods' windows must be below ``L``: only ``resolve`` can check that.)"""
    spec = ScalingRequest(method, factor=factor, target_length=target)
    try:
        spec.check()
        checked = None
    except RopeExtendError as exc:
        checked = exc
    try:
        registry.resolve(registry.get(method), factor=factor, target_length=target,
                         original_max_position_embeddings=2, params={})  # fmt: skip
        resolved = None
    except RopeExtendError as exc:
        resolved = exc
    assert (checked is None) == (resolved is None), (checked, resolved)


def test_the_earlier_name_of_the_request_warns_and_is_the_same_class():
    import warnings

    from rope_extend import scaling

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = scaling.ScalingSpec
    assert old is ScalingRequest
    assert [w.category for w in caught] == [DeprecationWarning]
    assert "rope_extend.scaling.ScalingRequest" in str(caught[0].message)
    with pytest.raises(AttributeError, match="no attribute 'ScalingSpeck'"):
        scaling.ScalingSpeck  # noqa: B018
