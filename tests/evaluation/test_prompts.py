import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_extend import RopeExtendError
from rope_extend.evaluation.niah import score as niah_score
from rope_extend.evaluation.passkey import first_integer, score
from rope_extend.evaluation.prompts import KEY_LINE, QUESTION, TASK, build, passkey_prompt
from tests.tiny import tiny_tokenizer

TOK = tiny_tokenizer()


@settings(max_examples=60, deadline=None)
@given(length=st.integers(80, 3000), depth=st.floats(0, 1), key=st.integers(1, 10**9))
def test_passkey_prompt_exact_length_and_key_recoverable(length, depth, key):
    p = passkey_prompt(TOK, length, key, depth)
    assert len(p.input_ids) == length
    text = TOK.decode(p.input_ids)
    assert text.count(KEY_LINE.format(key=key)) == 1
    assert text.startswith(TASK) and text.endswith(QUESTION)
    # the needle tokens decode to the key line, and sit where the prompt says
    assert KEY_LINE.format(key=key) in TOK.decode(p.input_ids[p.needle_start : p.needle_end])
    # on a sentence boundary, within one filler sentence (<= 8 tokens here) of the requested depth
    assert abs(p.actual_depth - depth) * p.filler_tokens <= 8
    before = TOK.decode(p.input_ids[: p.needle_start]).rstrip()
    assert before.endswith(".") or p.actual_depth == 1.0  # the very end of the filler also counts as a boundary


def test_depth_extremes_and_monotonic():
    starts = [passkey_prompt(TOK, 1000, 1234, d).needle_start for d in (0, 0.25, 0.5, 0.75, 1)]
    assert starts == sorted(starts) and len(set(starts)) == 5
    first, last = passkey_prompt(TOK, 1000, 1234, 0.0), passkey_prompt(TOK, 1000, 1234, 1.0)
    assert first.actual_depth == 0.0 and last.actual_depth == 1.0
    assert TOK.decode(first.input_ids[: first.needle_start]).strip() == TASK
    assert TOK.decode(last.input_ids[last.needle_end :]).strip() == QUESTION


def test_too_short_length_names_the_minimum():
    with pytest.raises(RopeExtendError, match=r"length 20 is too short.*lengths >= \d+"):
        passkey_prompt(TOK, 20, 1, 0.5)


def test_haystack_too_short_is_an_error():
    ids = TOK("The sky is blue. " * 5, add_special_tokens=False)["input_ids"]
    with pytest.raises(RopeExtendError, match="haystack text has .* tokens but length 500"):
        build(TOK, 500, 0.5, head="Read.", needle="A needle.", tail="Q?", haystack=ids)


@pytest.mark.parametrize(
    "text, expected",
    [
        (" 48213. Remember it.", 48213),
        ("is 007 and 12", 7),
        ("no digits here", None),
        ("x12y34", 12),
        ("", None),
    ],
)
def test_first_integer(text, expected):
    assert first_integer(text) == expected


def test_passkey_scoring_is_exact_match_of_first_integer():
    assert score(" 4213. Remember 4213.", 4213) == (4213, True)
    assert score(" 42130", 4213) == (42130, False)
    assert score(" 12 4213", 4213) == (12, False)  # only the first integer counts
    assert score(" I don't know", 4213) == (None, False)


def test_niah_scoring_is_case_insensitive_substring():
    assert niah_score(" eat a sandwich in DOLORES   park.", "Dolores Park")[1]
    assert not niah_score(" eat a sandwich in the park.", "Dolores Park")[1]
    assert re.search("Park", niah_score("  Dolores Park  ", "Dolores Park")[0])


PROSE = ["A heron stood in the shallows.", "Rain drummed on the tin roof!", "Who left the gate open?"]


@pytest.mark.parametrize("length, depth, start", [(120, 0.0, 0), (300, 0.5, 2), (900, 1.0, 1)])
def test_passkey_prompt_with_other_filler(length, depth, start):
    p = passkey_prompt(TOK, length, 4821, depth, filler=PROSE, start=start)
    assert len(p.input_ids) == length
    text = TOK.decode(p.input_ids)
    assert text.startswith(TASK) and text.endswith(QUESTION) and text.count(KEY_LINE.format(key=4821)) == 1
    assert "The grass is green" not in text and "heron" in text and "tin roof" in text
    body = text[len(TASK) :].lstrip()
    assert body.startswith(KEY_LINE.format(key=4821) if depth == 0 else PROSE[start])


def test_split_sentences():
    from rope_extend.evaluation.prompts import split_sentences

    assert split_sentences(" ".join(PROSE) + "\n") == PROSE
    assert split_sentences(["  One. ", "Two."]) == ["One.", "Two."]
    with pytest.raises(RopeExtendError, match="no sentences"):
        split_sentences("  ")
