"""The formulas of methods.md, computed independently in float64, and its reference values."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_extend import inv_freq
from rope_extend.methods.ntk import dynamic_alpha, ntk_base
from rope_extend.methods.yarn import correction_range, dynamic_yarn_factor

head_dims = st.sampled_from([8, 16, 32, 64, 96, 128, 256])
bases = st.sampled_from([10000.0, 500000.0]) | st.floats(100.0, 2e6)
factors = st.sampled_from([1.0, 2.0, 4.0, 16.0]) | st.floats(1.0, 64.0)
lengths = st.sampled_from([256, 4096, 8192]) | st.integers(64, 131072)


def theta(d, b):
    return b ** (-np.arange(0, d, 2, dtype=np.float64) / d)


def by_parts_reference(d, b, s, L, beta_fast=32.0, beta_slow=1.0):
    low = math.floor(d * math.log(L / (beta_fast * 2 * math.pi)) / (2 * math.log(b)))
    high = math.ceil(d * math.log(L / (beta_slow * 2 * math.pi)) / (2 * math.log(b)))
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    i = np.arange(d // 2, dtype=np.float64)
    ramp = np.clip((i - low) / (high - low), 0, 1)
    t = theta(d, b)
    return (t / s) * ramp + t * (1 - ramp)


def close(ours, reference, rtol=2e-6):
    np.testing.assert_allclose(ours.double().numpy(), reference, rtol=rtol, atol=0)


# ------------------------------------------------------------------ reference values of methods.md
def test_reference_values():
    assert correction_range(128, 10000.0, 4096, 32, 1) == (20, 46)
    expected = {2: 1.0693, 4: 1.1386, 8: 1.2079, 16: 1.2773, 32: 1.3466}
    for s, scale in expected.items():
        assert inv_freq("yarn", 128, 10000.0, s, 4096)[1] == pytest.approx(scale, abs=5e-5)
    assert ntk_base(10000.0, 16, 128) == pytest.approx(167198.74, abs=0.01)


# ------------------------------------------------------------------------------------ formulas
@settings(max_examples=60, deadline=None)
@given(head_dims, bases, factors, lengths)
def test_linear_formula(d, b, s, L):
    close(inv_freq("linear", d, b, s, L)[0], theta(d, b) / s)


@settings(max_examples=60, deadline=None)
@given(head_dims.filter(lambda d: d > 2), bases, factors, lengths, st.none() | st.floats(1.0, 100.0))
def test_ntk_formula(d, b, s, L, alpha):
    a = s if alpha is None else alpha
    kwargs = {} if alpha is None else {"alpha": alpha}
    freqs, scale = inv_freq("ntk", d, b, s, L, **kwargs)
    close(freqs, theta(d, b * a ** (d / (d - 2))), rtol=1e-5)
    assert scale == 1.0


@settings(max_examples=60, deadline=None)
@given(head_dims.filter(lambda d: d > 2), bases, factors, lengths, st.floats(0.01, 100.0))
def test_dynamic_formula_measures_against_the_original_length(d, b, s, L, ratio):
    seq_len = max(1, int(L * ratio))
    s_l = max(1.0, s * seq_len / L - (s - 1))
    assert dynamic_alpha(s, L, seq_len) == pytest.approx(s_l)
    close(inv_freq("dynamic", d, b, s, L, seq_len=seq_len)[0], theta(d, b * s_l ** (d / (d - 2))), rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(head_dims, bases, factors, lengths, st.sampled_from([(32.0, 1.0), (64.0, 2.0), (16.0, 0.5)]))
def test_ntk_by_parts_formula(d, b, s, L, betas):
    fast, slow = betas
    freqs, scale = inv_freq("ntk_by_parts", d, b, s, L, beta_fast=fast, beta_slow=slow)
    close(freqs, by_parts_reference(d, b, s, L, fast, slow))
    assert scale == 1.0


@settings(max_examples=60, deadline=None)
@given(head_dims, bases, factors, lengths)
def test_yarn_formula(d, b, s, L):
    freqs, scale = inv_freq("yarn", d, b, s, L)
    close(freqs, by_parts_reference(d, b, s, L))
    assert scale == pytest.approx(0.1 * math.log(s) + 1 if s > 1 else 1.0)


@settings(max_examples=60, deadline=None)
@given(head_dims, bases, factors, lengths, st.floats(0.01, 100.0), st.booleans())
def test_dynamic_yarn_formula(d, b, s, L, ratio, finetuned):
    seq_len = max(1, int(L * ratio))
    s_l = max(s if finetuned else 1.0, seq_len / L)
    assert dynamic_yarn_factor(s, L, seq_len, finetuned) == pytest.approx(s_l)
    freqs, scale = inv_freq("dynamic_yarn", d, b, s, L, seq_len=seq_len, finetuned=finetuned)
    close(freqs, by_parts_reference(d, b, s_l, L))
    assert scale == pytest.approx(0.1 * math.log(s_l) + 1 if s_l > 1 else 1.0)


@settings(max_examples=60, deadline=None)
@given(head_dims, bases, factors, lengths)
def test_llama3_formula(d, b, s, L):
    t = theta(d, b)
    lam = 2 * math.pi / t
    smooth = (L / lam - 1.0) / (4.0 - 1.0)
    expected = np.where(lam < L / 4, t, np.where(lam > L / 1, t / s, (1 - smooth) * t / s + smooth * t))
    freqs, scale = inv_freq("llama3", d, b, s, L)
    close(freqs, expected, rtol=1e-5)
    assert scale == 1.0


def test_longrope_switches_at_the_original_length_and_scales_attention():
    short, long = [1.0, 2.0, 3.0, 4.0], [8.0, 8.0, 16.0, 32.0]
    kwargs = dict(short_factor=short, long_factor=long)
    at_l = inv_freq("longrope", 8, 10000.0, 4.0, 1024, seq_len=1024, **kwargs)
    beyond = inv_freq("longrope", 8, 10000.0, 4.0, 1024, seq_len=1025, **kwargs)
    close(at_l[0], theta(8, 10000.0) / np.array(short))
    close(beyond[0], theta(8, 10000.0) / np.array(long))
    assert at_l[1] == beyond[1] == pytest.approx(math.sqrt(1 + math.log(4.0) / math.log(1024)))
    assert inv_freq("longrope", 8, 10000.0, 4.0, 1024, attention_factor=1.25, **kwargs)[1] == 1.25
    assert inv_freq("longrope", 8, 10000.0, 1.0, 1024, **kwargs)[1] == 1.0


def test_partial_rotary_returns_the_rotary_half():
    freqs, _ = inv_freq("yarn", 80, 10000.0, 4.0, 2048, partial_rotary_factor=0.4)
    assert freqs.shape == (16,)  # d = int(80 * 0.4) = 32, d/2 = 16
    close(freqs, by_parts_reference(32, 10000.0, 4.0, 2048))
