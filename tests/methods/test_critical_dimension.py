"""LongRoPE2's critical dimension: the first rotary dimension whose period the pretraining length did not cover."""

import math

import pytest

from rope_extend import RopeExtendError
from rope_extend.methods.longrope import critical_dimension


@pytest.mark.parametrize(("dim", "base", "L", "expected"), [
    (128, 10000.0, 4096, 92),     # LLaMA2: Liu et al. 2023 state 92 ("Scaling Laws of RoPE-based Extrapolation")
    (128, 500000.0, 8192, 70),    # Llama-3-8B, LongRoPE2's model: (64 log_500000(8192 / 2 pi) = 34.98 -> 35 pairs)
    (64, 100000.0, 8192, 40),     # SmolLM2-135M: 32 log_100000(1303.8) = 19.94 -> 20 pairs
    (64, 1600.0, 256, 34),        # the bundled testbed: 16.08 -> 17 pairs
    (96, 10000.0, 4096, 68),      # Phi-3-mini (head dimension 96, L 4096)
    # LongRoPE2 (arXiv 2502.20082) section 2.1, Eq. 7 and its worked example: Phi3-mini pretrained at 2048,
    # d_tcd 62 ("the 31st cosine dimension"); section 3.2: LLaMA3-8B's theoretical 35 pairs (70 above)
    (96, 10000.0, 2048, 62),      # 48 log_10000(2048 / 2 pi) = 30.16 -> 31 pairs
])  # fmt: skip
def test_the_critical_dimension_of_known_models(dim, base, L, expected):
    assert critical_dimension(dim, base, L) == expected
    pair = expected // 2
    # the definition: pair `pair` is the first whose period 2 pi base^(2 pair / d) reaches L
    assert 2 * math.pi * base ** (2 * pair / dim) >= L > 2 * math.pi * base ** (2 * (pair - 1) / dim)


def test_the_ends():
    assert critical_dimension(64, 10000.0, 6) == 0  # L shorter than the fastest period (2 pi): none was covered
    assert critical_dimension(64, 2.0, 1 << 20) == 64  # a base so small every period fits in L: past the last


@pytest.mark.parametrize(("args", "match"), [
    ((63, 10000.0, 4096), "even integer >= 2"),
    ((64, 1.0, 4096), "base must be > 1"),
    ((64, float("nan"), 4096), "base must be a finite number"),
    ((64, 10000.0, 0), "positive integer"),
    ((64, 10000.0, 4096.5), "positive integer"),
])  # fmt: skip
def test_bad_numbers(args, match):
    with pytest.raises(RopeExtendError, match=match):
        critical_dimension(*args)
