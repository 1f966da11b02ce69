import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_extend import RopeExtendError
from rope_extend.evaluation.effective import RULER_THRESHOLD, SLACK, effective_length, effective_lengths

scores = st.dictionaries(st.integers(1, 1 << 20), st.floats(0, 100, allow_nan=False), min_size=1, max_size=8)


def test_rulers_rule_on_a_hand_made_table():
    table = {4096: 91.2, 8192: 86.0, 16384: 85.6, 32768: 70.1}
    assert RULER_THRESHOLD == 85.6
    assert effective_length(table) == 16384  # at the threshold counts
    assert effective_length(table, 90) == 4096 and effective_length(table, 95) is None
    assert effective_length({4096: 80.0, 8192: 88.0}) == 8192  # the longest qualifying, as RULER
    e = effective_lengths(table, reference_length=8192, keep=0.8)
    assert (e.length, e.reference_score, e.relative_length) == (16384, 86.0, 32768)  # 70.1 >= 68.8
    assert effective_lengths(table).reference_length == 4096  # default: the shortest measured
    assert effective_lengths({1: 50.0, 2: 45.0}, keep=0.9).relative_length == 2  # exactly 90% counts


@settings(max_examples=200, deadline=None)
@given(scores, st.floats(0, 100, allow_nan=False))
def test_effective_length_is_the_longest_length_at_or_above(table, threshold):
    got = effective_length(table, threshold)
    passing = [n for n, v in table.items() if v >= threshold - SLACK]
    assert got == (max(passing) if passing else None)
    if got is not None:
        assert table[got] >= threshold - SLACK and all(v < threshold - SLACK for n, v in table.items() if n > got)
    # a lower bar never gives a shorter effective length
    lower = effective_length(table, threshold / 2)
    assert got is None or (lower is not None and lower >= got)


@settings(max_examples=200, deadline=None)
@given(scores, st.floats(0.01, 1))
def test_relative_length_keeps_the_share_of_the_reference(table, keep):
    """(A score of 0 at the reference gives no relative length: every length would keep "all" of nothing.)"""
    ref = min(table)
    e = effective_lengths(table, keep=keep)
    assert e.reference_length == ref and e.reference_score == table[ref]
    if table[ref] <= 0:  # nothing to keep a share of
        assert e.relative_length is None
        return
    assert e.relative_length == effective_length(table, keep * table[ref])
    assert e.relative_length is not None and e.relative_length >= ref  # the reference keeps all of itself
    assert e.as_dict()["keep"] == keep


def test_bad_input_names_the_parameter():
    with pytest.raises(RopeExtendError, match="reference_length 2048 was not measured; measured lengths: 4096"):
        effective_lengths({4096: 1.0}, reference_length=2048)
    with pytest.raises(RopeExtendError, match=r"keep must be a share in \(0, 1\], got 1.5"):
        effective_lengths({4096: 1.0}, keep=1.5)
    with pytest.raises(RopeExtendError, match="threshold must be a finite number"):
        effective_length({4096: 1.0}, float("nan"))
    with pytest.raises(RopeExtendError, match="the score at 4096 must be a finite number"):
        effective_length({4096: float("inf")})
    with pytest.raises(RopeExtendError, match="needs scores at one length"):
        effective_length({})


def test_no_relative_length_when_the_reference_scores_zero():
    e = effective_lengths({256: 0.0, 512: 0.0, 1024: 10.0}, reference_length=256)
    assert e.relative_length is None and e.length is None
