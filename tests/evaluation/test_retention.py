import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_extend import RopeExtendError
from rope_extend.evaluation.retention import perplexity_retention, retention, retention_from_records

pairs = st.lists(
    st.tuples(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.sampled_from([0.0, 0.5, 1.0])), min_size=2, max_size=40
)


def test_ratio_and_interval_on_a_hand_made_case():
    r = retention([1.0] * 8 + [0.0] * 2, [1.0] * 7 + [0.0] * 3, resamples=4000, seed=1)
    assert r.ratio == pytest.approx(0.7 / 0.8) and r.original == 0.8 and r.patched == pytest.approx(0.7)
    assert r.low < r.ratio <= r.high <= 1.0  # the patched never beats the original on any example here
    assert (r.kind, r.method, r.examples, r.confidence) == ("score", "paired percentile bootstrap", 10, 0.95)
    same = retention([1.0, 0.5, 0.0, 1.0], [1.0, 0.5, 0.0, 1.0])
    assert (same.ratio, same.low, same.high) == (1.0, 1.0, 1.0)  # identical answers: no spread at all


@settings(max_examples=100, deadline=None)
@given(pairs, st.integers(0, 2**31))
def test_retention_is_deterministic_and_brackets_the_ratio(data, seed):
    o, p = [a for a, _ in data], [b for _, b in data]
    if sum(o) == 0:
        with pytest.raises(RopeExtendError, match="original scores 0 on every example"):
            retention(o, p, seed=seed, resamples=200)
        return
    a = retention(o, p, seed=seed, resamples=200)
    assert a == retention(o, p, seed=seed, resamples=200)  # the same seed, the same interval
    assert a.ratio == pytest.approx(sum(p) / sum(o))
    assert a.low <= a.high and a.low >= 0
    # a wider confidence never gives a narrower interval from the same draws
    wide = retention(o, p, seed=seed, resamples=200, confidence=0.99)
    assert wide.low <= a.low and wide.high >= a.high


def test_perplexity_retention_is_token_weighted():
    orig = [(2.0 * 100, 100), (3.0 * 300, 300)]  # nll sums, tokens
    pat = [(2.1 * 100, 100), (3.3 * 300, 300)]
    r = perplexity_retention(orig, pat, seed=0)
    assert r.original == pytest.approx(math.exp(1100 / 400)) and r.patched == pytest.approx(math.exp(1200 / 400))
    assert r.ratio == pytest.approx(math.exp(-100 / 400)) and r.kind == "perplexity"
    assert r.low <= r.ratio <= r.high < 1  # worse on both documents: below 1 in every resample
    with pytest.raises(RopeExtendError, match="scored token counts differ"):
        perplexity_retention(orig, [(1.0, 99), (1.0, 300)])


def test_from_records_pairs_the_examples_inside_the_length():
    def ruler(score, task, length, sample):
        return {"task": "ruler", "ruler_task": task, "length": length, "sample": sample, "score": score}

    orig = [ruler(1.0, "vt", 4096, i) for i in range(4)] + [ruler(1.0, "vt", 8192, 0)]
    orig += [{"task": "passkey", "length": 4096, "depth_grid": None, "trial": i, "correct": True} for i in range(3)]
    orig += [{"task": "perplexity", "length": 4096, "doc": 0, "text": "d", "nll": 200.0, "tokens": 100}]
    pat = [dict(r, score=0.5 if r.get("sample") == 0 else 1.0) for r in orig if r["task"] == "ruler"]
    pat = [r for r in pat if r["length"] <= 4096]  # the patched run never went past 4k: not needed inside it
    pat += [dict(r, correct=r["trial"] != 2) for r in orig if r["task"] == "passkey"]
    pat += [dict(orig[-1], nll=210.0)]
    got = retention_from_records(orig, pat, within=4096, seed=3)
    assert set(got) == {"ruler", "ruler:vt", "passkey", "perplexity"}
    assert got["ruler"].ratio == pytest.approx(3.5 / 4) and got["ruler"].examples == 4
    assert got["passkey"].ratio == pytest.approx(2 / 3)
    assert got["perplexity"].ratio == pytest.approx(math.exp(-0.1))
    with pytest.raises(RopeExtendError, match="retention compares the same ruler examples: 1 of the original's"):
        retention_from_records(orig, pat, within=8192)
    with pytest.raises(RopeExtendError, match="hold ruler example .* twice"):
        retention_from_records(orig + orig[:1], pat, within=4096)


def test_bad_input_names_the_parameter():
    with pytest.raises(RopeExtendError, match="the original has 2 scores, the patched 1"):
        retention([1.0, 1.0], [1.0])
    with pytest.raises(RopeExtendError, match=r"confidence must be a share in \(0, 1\), got 1"):
        retention([1.0], [1.0], confidence=1)
    with pytest.raises(RopeExtendError, match="resamples must be an integer >= 100, got 10"):
        retention([1.0], [1.0], resamples=10)
    with pytest.raises(RopeExtendError, match="within must be a positive integer"):
        retention_from_records([], [], within=0)
