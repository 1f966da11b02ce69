"""rope_extend.errors: one base class under every exception rope-extend raises, each also the builtin it was."""

import warnings

import pytest

import rope_extend
from rope_extend import errors


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (rope_extend.RopeExtendError, ValueError),
        (rope_extend.UnsupportedModelError, TypeError),
        (rope_extend.NotPatchedError, RuntimeError),
    ],
)
def test_each_error_is_the_base_and_its_builtin(error, builtin):
    assert issubclass(error, rope_extend.RopeExtendBaseError) and issubclass(error, builtin)
    for catch in (rope_extend.RopeExtendBaseError, builtin, error):
        with pytest.raises(catch, match="named"):
            raise error("named")


def test_the_base_is_no_builtin_and_the_errors_are_apart():
    base = rope_extend.RopeExtendBaseError
    assert base.__bases__ == (Exception,)
    assert not issubclass(base, (ValueError, TypeError, RuntimeError))
    assert not issubclass(rope_extend.UnsupportedModelError, rope_extend.RopeExtendError)
    assert not issubclass(rope_extend.RopeExtendError, rope_extend.UnsupportedModelError)


def test_every_exception_class_of_the_module_is_under_the_base():
    classes = {v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, BaseException)}
    assert classes == {
        errors.RopeExtendBaseError,
        errors.RopeExtendError,
        errors.UnsupportedModelError,
        errors.NotPatchedError,
    }
    assert all(issubclass(c, errors.RopeExtendBaseError) for c in classes)


def test_the_earlier_name_of_the_base_warns_and_is_the_same_class():
    for owner in (errors, rope_extend):
        vars(owner).pop("RopeExtendException", None)  # the package keeps what it read once
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old = owner.RopeExtendException
        assert old is rope_extend.RopeExtendBaseError
        assert [w.category for w in caught] == [DeprecationWarning]
        assert "RopeExtendBaseError" in str(caught[0].message)
    assert "RopeExtendException" not in rope_extend.__all__


def test_a_real_refusal_is_caught_by_the_base_and_by_valueerror():
    with pytest.raises(rope_extend.RopeExtendBaseError, match="nope"):
        rope_extend.get_method("nope")
    with pytest.raises(ValueError, match="nope"):
        rope_extend.get_method("nope")
