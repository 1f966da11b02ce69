"""The LongRoPE search space: every operator keeps candidates non-decreasing, bounded and on the grid."""

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_extend import RopeExtendError
from rope_extend.factor_search import evolution as E
from rope_extend.factor_search.run import seed_factors
from rope_extend.methods._common import rope_frequencies
from rope_extend.methods.registry import inv_freq

factors = st.floats(1.5, 32.0)
raw = st.lists(st.floats(-5.0, 50.0, allow_nan=False), min_size=1, max_size=64)


def on_grid(values):
    return all(abs(v * 100 - round(v * 100)) < 1e-6 for v in values)


@given(raw, factors)
def test_repair_gives_a_valid_candidate_and_keeps_valid_ones(values, s):
    space = E.Space.for_factor(len(values), s)
    fixed = E.repair(space, values)
    assert E.valid(space, fixed) and on_grid(fixed)
    assert E.repair(space, fixed) == fixed  # idempotent


@settings(max_examples=60)
@given(st.integers(2, 48), factors, st.integers(0, 10_000))
def test_mutation_crossover_and_offspring_stay_in_the_space(size, s, seed):
    space = E.Space.for_factor(size, s)
    rng = random.Random(seed)
    a = E.repair(space, sorted(rng.uniform(1, space.high) for _ in range(size)))
    b = E.repair(space, sorted(rng.uniform(1, space.high) for _ in range(size)))
    assert E.valid(space, E.mutate(space, a, rng))
    assert E.valid(space, E.crossover(space, a, b, rng))
    seen = {tuple(a), tuple(b)}
    kids = E.offspring(space, [a, b], 6, rng, seen)
    assert all(E.valid(space, k) and on_grid(k) for k in kids)
    assert len({tuple(k) for k in kids}) == len(kids) and not {tuple(a), tuple(b)} & {tuple(k) for k in kids}


def test_crossover_takes_a_head_and_a_tail():
    space = E.Space(8, 1.0, 10.0)
    a, b = [1.0] * 8, [5.0] * 8
    child = E.crossover(space, a, b, random.Random(3))
    cut = child.index(5.0)
    assert 1 <= cut < 8 and child == [1.0] * cut + [5.0] * (8 - cut)


def test_the_space_has_the_papers_bounds():
    space = E.Space.for_factor(32, 4)
    assert (space.low, space.high) == (1.0, 5.0)
    assert E.repair(E.Space(3, 1.0, 5.0), [0.2, 7.0, 3.0]) == [1.0, 5.0, 5.0]
    assert E.repair(E.Space(3, 1.0, 5.0), [1.234, 1.231, 2.0]) == [1.24, 1.24, 2.0]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"size": 0, "low": 1.0, "high": 2.0}, "at least one factor"),
    ({"size": 4, "low": 0.5, "high": 2.0}, "1 <= low < high"),
    ({"size": 4, "low": 3.0, "high": 2.0}, "1 <= low < high"),
])  # fmt: skip
def test_space_errors(kwargs, match):
    with pytest.raises(RopeExtendError, match=match):
        E.Space(**kwargs)


@pytest.mark.parametrize("s", [1.0, 0.5, float("inf"), "4"])
def test_factor_must_extend(s):
    with pytest.raises(RopeExtendError, match="extension factor > 1"):
        E.Space.for_factor(8, s)


@pytest.mark.parametrize("method", ["linear", "ntk", "yarn"])
def test_seeds_are_the_factors_patch_applies(method):
    dim, base, L, s = 64, 10000.0, 4096, 4.0
    lam = seed_factors(method, dim, base, s, L)
    scaled, _ = inv_freq(method, dim, base, s, L)
    back = rope_frequencies(dim, base) / torch.tensor(lam, dtype=scaled.dtype)
    assert back.sub(scaled).abs().max() <= 1e-6 * scaled.abs().max()
    assert all(a <= b + 1e-9 for a, b in itertools.pairwise(lam))  # all three are non-decreasing already
    if method == "linear":
        assert lam == pytest.approx([s] * 32)
    else:
        assert lam[0] == pytest.approx(1.0, abs=0.02) and lam[-1] == pytest.approx(s, rel=0.05)


def test_the_longrope2_space_splits_at_the_critical_pair():
    # LongRoPE2 (arXiv 2502.20082, Algorithm 2; J-shang/LongRoPE dev/nishang/omni evolution/algorithms/
    # dim_mono.py): from the critical pair on, searched in [s, 2 s] and non-decreasing; below it, NTK scaling
    # from the critical pair's factor, lambda_i = lambda_c^(i / c)
    space = E.Space.for_critical(8, 4.0, 3)
    assert space.tied == 3 and [space.bounds(i) for i in (3, 7)] == [(4.0, 8.0), (4.0, 8.0)]
    assert E.repair(space, [0.5, 4.6, 2.0, 8.0, 9.0, 4.2, 4.1, 4.0]) == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0, 8.0]
    assert E.repair(space, [1.0] * 8) == [1.0, round(4 ** (1 / 3), 6), round(4 ** (2 / 3), 6), 4.0, 4.0, 4.0, 4.0, 4.0]
    # the pairs below the critical one never push the searched ones up (only pair 3 on is read)
    assert E.repair(space, [9.0, 9.0, 9.0, 4.0, 4.0, 4.0, 4.0, 4.0]) == E.repair(space, [1.0] * 8)
    assert not E.valid(space, [1.0] * 8) and E.valid(space, E.repair(space, [1.0] * 8))
    assert not E.valid(space, [1.0, 1.0, 1.0, 4.0, 4.0, 4.0, 4.0, 4.0])  # free lower pairs are not in this space
    odd = E.Space.for_critical(4, 3.333, 2)  # an s off the 0.01 grid: the floor is rounded up onto it
    assert odd.floor == 3.34 and E.valid(odd, E.repair(odd, [1.0, 9.0, 1.0, 1.0]))
    past = E.Space.for_critical(4, 2.0, 99)  # every pair below a critical pair past the last: free in [1, s]
    assert past.critical == 4 and past.tied == 0 and E.repair(past, [0.5, 3.0, 1.5, 9.0]) == [1.0, 2.0, 2.0, 2.0]
    rng = random.Random(0)
    for _ in range(20):  # mutation moves only the searched pairs; the lower ones follow
        child = E.mutate(space, E.repair(space, [1.0] * 8), rng)
        assert E.valid(space, child) and child[:3] == E.repair(space, child)[:3]


@settings(max_examples=40)
@given(st.integers(2, 48), factors, st.integers(0, 60), st.integers(0, 10_000))
def test_operators_stay_in_the_longrope2_space(size, s, critical, seed):
    space = E.Space.for_critical(size, s, critical)
    rng = random.Random(seed)
    assert space.tied == (critical if critical < size else 0)
    parents = [E.repair(space, [rng.uniform(0, 2 * s) for _ in range(size)]) for _ in range(3)]
    for child in E.offspring(space, parents, 6, rng, set()):
        assert E.valid(space, child)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"size": 4, "low": 1.0, "high": 5.0, "critical": 2}, "both critical and floor"),
    ({"size": 4, "low": 1.0, "high": 5.0, "critical": 2, "floor": 6.0}, r"floor must lie in \[low, high\]"),
])  # fmt: skip
def test_split_space_errors(kwargs, match):
    with pytest.raises(RopeExtendError, match=match):
        E.Space(**kwargs)
    with pytest.raises(RopeExtendError, match="critical pair index must be an integer >= 0"):
        E.Space.for_critical(4, 2.0, -1)
