"""Properties every method must have (methods.md)."""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rope_extend import inv_freq, method_names
from rope_extend.methods import rope_frequencies
from rope_extend.methods.yarn import correction_range

head_dims = st.sampled_from([8, 16, 32, 64, 128, 256])
bases = st.sampled_from([10000.0, 500000.0]) | st.floats(100.0, 2e6)
factors = st.floats(1.0, 64.0)
lengths = st.integers(64, 131072)
STATIC = ["linear", "ntk", "ntk_by_parts", "yarn", "llama3"]


def params_for(method, d):
    if method == "longrope":
        return {"short_factor": [1.0] * (d // 2), "long_factor": [4.0] * (d // 2)}
    return {}


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(STATIC + ["longrope"]), head_dims.filter(lambda d: d > 2), bases, lengths)
def test_factor_one_is_plain_rope(method, d, b, L):
    freqs, scale = inv_freq(method, d, b, 1.0, L, **params_for(method, d))
    assert torch.equal(freqs, rope_frequencies(d, b))
    assert scale == 1.0


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["dynamic", "dynamic_yarn"]),
    head_dims.filter(lambda d: d > 2),
    bases,
    factors,
    lengths,
    st.floats(0.0, 1.0),
)
def test_dynamic_methods_are_plain_rope_inside_the_original_length(method, d, b, s, L, frac):
    seq_len = max(1, int(L * frac))
    freqs, scale = inv_freq(method, d, b, s, L, seq_len=seq_len)
    assert torch.equal(freqs, rope_frequencies(d, b)) and scale == 1.0


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["ntk", "ntk_by_parts", "yarn", "llama3"]),
    head_dims.filter(lambda d: d > 2),
    bases,
    factors,
    lengths,
)
def test_highest_frequency_is_untouched(method, d, b, s, L):
    assume(method != "llama3" or 2 * math.pi < L / 4.0)  # llama3 keeps wavelengths below L/high_freq_factor
    # ntk_by_parts/yarn keep a frequency turning more than beta_fast times inside L (dim index below low)
    assume(method not in ("ntk_by_parts", "yarn") or correction_range(d, b, L, 32, 1)[0] >= 1)
    freqs, _ = inv_freq(method, d, b, s, L)
    assert freqs[0].item() == pytest.approx(1.0, rel=1e-7)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["linear", "yarn"]), head_dims, bases, factors, lengths)
def test_lowest_frequency_is_divided_by_the_factor(method, d, b, s, L):
    # yarn interpolates fully once the ramp has ended before the last pair (it turns < beta_slow times in L)
    assume(method == "linear" or correction_range(d, b, L, 32, 1)[1] <= d // 2 - 1)
    freqs, _ = inv_freq(method, d, b, s, L)
    plain = rope_frequencies(d, b)
    assert freqs[-1].item() == pytest.approx(plain[-1].item() / s, rel=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(STATIC), head_dims.filter(lambda d: d > 2), bases, factors, lengths)
def test_scaled_frequencies_never_exceed_plain_ones_and_stay_positive(method, d, b, s, L):
    freqs, _ = inv_freq(method, d, b, s, L)
    plain = rope_frequencies(d, b)
    assert (freqs > 0).all()
    assert (freqs <= plain * (1 + 1e-6)).all()
    assert (freqs >= plain / s * (1 - 1e-6)).all() or method == "ntk"


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["dynamic", "dynamic_yarn"]),
    head_dims.filter(lambda d: d > 2),
    factors,
    st.integers(256, 8192),
    st.integers(1, 50000),
    st.integers(1, 50000),
)
def test_dynamic_frequencies_fall_as_the_length_grows(method, d, s, L, l1, l2):
    short, long = sorted((l1, l2))
    f_short, _ = inv_freq(method, d, 10000.0, s, L, seq_len=short)
    f_long, _ = inv_freq(method, d, 10000.0, s, L, seq_len=long)
    assert (f_long <= f_short * (1 + 1e-6)).all()


def test_every_method_returns_float32_of_half_the_rotary_dim():
    for method in method_names():
        freqs, scale = inv_freq(method, 64, 10000.0, 4.0, 2048, partial_rotary_factor=0.5, **params_for(method, 32))
        assert freqs.dtype == torch.float32 and freqs.shape == (16,)
        assert isinstance(scale, float) and scale > 0
