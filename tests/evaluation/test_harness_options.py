"""Each harness takes its task's options dataclass: the options are declared once (defaults and checks in the
dataclass), and the harness's keywords are built into it, with errors that name the harness."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from rope_extend.errors import RopeExtendError
from rope_extend.evaluation.niah import niah
from rope_extend.evaluation.passkey import PasskeyOptions, passkey
from rope_extend.evaluation.perplexity import perplexity
from rope_extend.evaluation.ruler import ruler
from rope_extend.evaluation.tasks import READING, get_task, options_for

HARNESSES = {"passkey": passkey, "niah": niah, "perplexity": perplexity, "ruler": ruler}


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_no_option_is_declared_again_in_the_harness_signature(name):
    """A field of the task's options is never a parameter of its harness (``lengths`` aside, positional for
    convenience): a default or a check cannot drift between the two."""
    options = get_task(name).options
    parameters = set(inspect.signature(HARNESSES[name]).parameters) - {"lengths"}
    assert not parameters & {f.name for f in dataclasses.fields(options)}
    assert "options" in parameters


def test_keywords_build_the_dataclass_with_its_defaults_and_checks():
    built = options_for(PasskeyOptions, None, {"lengths": "1k,2k", "key_range": (3, 9)}, harness="passkey")
    assert built == PasskeyOptions(lengths=[1024, 2048], key_range=[3, 9])
    assert built.trials == PasskeyOptions.__dataclass_fields__["trials"].default == 10


def test_options_are_passed_through_unchanged():
    options = PasskeyOptions(lengths=[512], trials=2)
    assert options_for(PasskeyOptions, options, {}, harness="passkey") is options


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: passkey(None, None, "1k", trails=3), r"passkey\(\): unknown keyword 'trails' \(did you mean 'trials'"),
        (lambda: passkey(None, None), r"passkey\(\) is missing 'lengths'"),
        (
            lambda: passkey(None, None, "1k", options=PasskeyOptions(lengths=[512])),
            r"passkey\(\): give options= or keywords \(lengths\), not both",
        ),
        (lambda: passkey(None, None, options={"lengths": [512]}), r"options must be a PasskeyOptions, got dict"),
        (lambda: passkey(None, None, "1k", key_range=(1.5, 3)), r"key_range must be two integers"),
        (lambda: perplexity(None, None, ["text"], "1k", stride=2048), r"stride 2048 is larger than the window"),
        # the texts are the harness's argument: what reads them is the task's, not a keyword here
        (lambda: niah(None, None, ["text"], "1k", data="x.txt"), r"niah\(\): unknown keyword 'data'"),
        (lambda: ruler(None, None, "1k", sample_by="line"), r"ruler\(\): unknown keyword 'sample_by'"),
    ],
)
def test_bad_keywords_fail_before_the_model_is_touched(call, message):
    with pytest.raises(RopeExtendError, match=message):
        call()


def test_reading_fields_are_those_of_text_options():
    from rope_extend.evaluation.tasks import TextOptions

    assert set(READING) == {f.name for f in dataclasses.fields(TextOptions)} - {"max_docs"}
