"""Bad arguments raise at once, naming the problem and what is allowed."""

import pytest

from rope_extend import RopeExtendError, inv_freq, method_names
from rope_extend.methods import Method, get, register, resolve
from rope_extend.methods.linear import LinearParams, linear


def test_unknown_method_lists_the_known_ones():
    with pytest.raises(RopeExtendError) as err:
        inv_freq("yaarn", 64, 10000.0, 2.0, 2048)
    message = str(err.value)
    assert "'yaarn'" in message and "did you mean 'yarn'" in message
    for name in method_names():
        assert name in message


@pytest.mark.parametrize("factor", [0.5, 0.999, -2, 0, float("nan"), float("inf"), "4", None, True])
def test_bad_factor(factor):
    with pytest.raises(RopeExtendError, match="factor"):
        inv_freq("yarn", 64, 10000.0, factor, 2048)


def test_unknown_parameter_is_named_with_the_allowed_ones():
    with pytest.raises(RopeExtendError) as err:
        inv_freq("yarn", 64, 10000.0, 2.0, 2048, beta_fats=32)
    message = str(err.value)
    assert "beta_fats" in message and "did you mean 'beta_fast'" in message and "attention_factor" in message
    with pytest.raises(RopeExtendError, match="its parameters are: none"):
        inv_freq("linear", 64, 10000.0, 2.0, 2048, alpha=2)


@pytest.mark.parametrize(
    "method,params,needle",
    [
        ("yarn", {"beta_fast": 1.0, "beta_slow": 2.0}, "beta_fast must be greater than beta_slow"),
        ("yarn", {"beta_fast": -1.0}, "beta_fast must be > 0"),
        ("yarn", {"attention_factor": 0}, "attention_factor must be > 0"),
        ("yarn", {"truncate": "yes"}, "truncate must be true or false"),
        ("dynamic_yarn", {"finetuned": 1}, "finetuned must be true or false"),
        ("ntk", {"alpha": 0.5}, "alpha must be >= 1"),
        ("llama3", {"low_freq_factor": 4.0, "high_freq_factor": 1.0}, "high_freq_factor must be greater"),
        ("longrope", {}, "longrope needs short_factor"),
        ("longrope", {"short_factor": [1.0] * 32, "long_factor": [1.0] * 31}, "same length"),
        ("longrope", {"short_factor": [1.0] * 8, "long_factor": [1.0] * 8}, "needs d/2 = 32"),
        (
            "longrope",
            {"short_factor": [1.0] * 31 + [0.0], "long_factor": [1.0] * 32},
            r"short_factor\[31\] must be > 0",
        ),
    ],
)
def test_invalid_parameter_values(method, params, needle):
    with pytest.raises(RopeExtendError, match=needle):
        inv_freq(method, 64, 10000.0, 2.0, 2048, **params)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(head_dim=63), "even integer"),
        (dict(head_dim=0), "head_dim must be an integer >= 2"),
        (dict(partial_rotary_factor=1.5), r"partial_rotary_factor must be in \(0, 1\]"),
        (dict(base=1.0), "base"),
        (dict(original_max_position_embeddings=0), "original_max_position_embeddings"),
        (dict(seq_len=0), "seq_len"),
    ],
)
def test_bad_geometry(kwargs, needle):
    args = dict(head_dim=64, base=10000.0, factor=2.0, original_max_position_embeddings=2048)
    args.update(kwargs)
    seq_len = args.pop("seq_len", None)
    prf = args.pop("partial_rotary_factor", 1.0)
    with pytest.raises(RopeExtendError, match=needle):
        inv_freq(
            "yarn",
            args["head_dim"],
            args["base"],
            args["factor"],
            args["original_max_position_embeddings"],
            seq_len=seq_len,
            partial_rotary_factor=prf,
        )


def test_resolve_needs_exactly_one_of_factor_and_target_length():
    yarn = get("yarn")
    with pytest.raises(RopeExtendError, match="exactly one of factor"):
        resolve(yarn, original_max_position_embeddings=4096, params={})
    with pytest.raises(RopeExtendError, match="exactly one of factor"):
        resolve(yarn, factor=2, target_length=8192, original_max_position_embeddings=4096, params={})
    with pytest.raises(RopeExtendError, match="target_length must be >= the original length"):
        resolve(yarn, target_length=2048, original_max_position_embeddings=4096, params={})
    scaling = resolve(yarn, target_length=10000, original_max_position_embeddings=4096, params={})
    assert scaling.factor == pytest.approx(10000 / 4096) and scaling.target_length == 10000


def test_registry_refuses_duplicates():
    with pytest.raises(RopeExtendError, match="already registered"):
        register(Method("yarn", LinearParams, linear, rope_type="something_new"))
    with pytest.raises(RopeExtendError, match="rope_type 'yarn' is already used"):
        register(Method("my_yarn", LinearParams, linear, rope_type="yarn"))


HUGE = [
    ("4" * 10**8, "'44444"),  # a string of 100 MB (a YAML or JSON value): plain repr made a 100 MB message
    (list(range(10**7)), "[0, 1, 2, 3, 4, 5, 6, 7, ...]"),
    (-(10**5000), "<an integer of 16610 bits>"),  # repr raised ValueError (past 4300 digits)
]


@pytest.mark.parametrize("check", ["check_int", "check_number"])
@pytest.mark.parametrize("value, shown", HUGE, ids=["string", "list", "negative int"])
def test_a_huge_value_is_named_in_a_short_message_at_once(check, value, shown):
    """The argument checks every reader of a user's config calls (``check_int``, ``check_number``, through
    ``resolve`` and the audit's reference) show the value bounded (``errors.shown``): one short line, at once."""
    import time

    from rope_extend.methods import _common

    start = time.perf_counter()
    with pytest.raises(RopeExtendError) as err:
        getattr(_common, check)("original_max_position_embeddings", value)
    took = time.perf_counter() - start
    message = str(err.value)
    assert message.startswith("original_max_position_embeddings must be ") and shown in message, message[:200]
    assert len(message) < 200 and took < 0.5, (len(message), took)
    with pytest.raises(RopeExtendError) as err:  # through resolve, as a config's rope dict reaches it
        resolve(get("yarn"), factor=2.0, original_max_position_embeddings=value, params={})
    assert len(str(err.value)) < 200 and shown in str(err.value)


def test_an_integer_too_large_for_a_float_is_not_a_finite_number():
    """``10**5000`` made ``math.isfinite`` raise OverflowError (a traceback) where a number was checked."""
    from rope_extend.methods._common import check_number

    with pytest.raises(RopeExtendError, match=r"^factor must be a finite number, got <an integer of 16610 bits>$"):
        check_number("factor", 10**5000)


TOO_LONG = "2**40 = 1099511627776 tokens (longer than any sequence a model can be run on)"


@pytest.mark.parametrize(
    "amounts, message",
    [
        (dict(factor=2.0, original_max_position_embeddings=10**5000),  # a traceback in float(s * L)
         f"original_max_position_embeddings must be <= {TOO_LONG}, got <an integer of 16610 bits>"),
        (dict(factor=2.0, original_max_position_embeddings=2**40 + 1),
         f"original_max_position_embeddings must be <= {TOO_LONG}, got 1099511627777"),
        (dict(factor=2.0, original_max_position_embeddings=1),  # LongRoPE's scale divided by ln 1 = 0
         "original_max_position_embeddings must be an integer >= 2, got 1"),
        (dict(target_length=2**40 + 1, original_max_position_embeddings=4096),
         f"target_length must be <= {TOO_LONG}, got 1099511627777"),
        (dict(factor=1e300, original_max_position_embeddings=4096),  # an infinite target: round(inf) raised
         f"factor must be <= 2**40: s x L would pass {TOO_LONG}, got 1e+300"),
        (dict(factor=2.0**30, original_max_position_embeddings=4096),  # each within the bound, their product not
         f"factor 1.07374e+09 x L=4096 is 4.398e+12 tokens, past {TOO_LONG}"),
    ],
    ids=["huge L", "L past", "L of 1", "target past", "huge factor", "product past"],
)  # fmt: skip
def test_every_length_is_bounded_by_the_one_maximum(amounts, message):
    """``resolve`` holds ``L``, the target and ``s x L`` to ``methods.MAX_LENGTH`` (2**40 tokens) and ``L`` to at
    least 2, as every other reader of a length does (``check_length``): the scaling spec before any model, the
    frequencies' ``seq_len``, ``hf.reading`` and the audit. Before, ``10**5000`` was accepted and a traceback
    later, and ``L = 1`` a ZeroDivisionError in LongRoPE's scale."""
    from rope_extend.scaling import ScalingRequest

    with pytest.raises(RopeExtendError) as err:
        resolve(get("yarn"), params={}, **amounts)
    assert str(err.value) == message
    if "target" not in message and "x L=" not in message:  # what the spec can tell without the model's L
        with pytest.raises(RopeExtendError) as err:
            ScalingRequest("yarn", **amounts).check()
        assert str(err.value) == message
    longest = resolve(get("yarn"), factor=1.0, original_max_position_embeddings=2**40, params={})
    assert longest.target_length == 2**40
    assert resolve(get("yarn"), target_length=2**40, original_max_position_embeddings=2, params={}).factor == 2**39
    with pytest.raises(RopeExtendError, match=r"^seq_len must be <= 2\*\*40 = 1099511627776 tokens"):
        inv_freq("dynamic", 64, 10000.0, 2.0, 2048, seq_len=2**40 + 1)
    with pytest.raises(RopeExtendError, match="original_max_position_embeddings must be an integer >= 2"):
        inv_freq("longrope", 4, 10000.0, 2.0, 1, short_factor=[1.0, 1.0], long_factor=[1.0, 1.0])
