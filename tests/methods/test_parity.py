"""Parity with transformers' ROPE_INIT_FUNCTIONS for the methods both implement.

rope-extend computes with the same float32 operations, so the frequencies are bit-identical and the
attention scales equal; hypothesis draws head dims, bases, factors, lengths and parameters.
"""

import math

import pytest
import torch
import transformers as T
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from rope_extend import inv_freq

head_dims = st.sampled_from([16, 32, 48, 64, 80, 96, 128, 256])
bases = st.sampled_from([10000.0, 500000.0, 1000000.0]) | st.floats(100.0, 2e6)
factors = st.sampled_from([1.0, 2.0, 4.0, 8.0, 16.0, 32.0]) | st.floats(1.0, 64.0)
lengths = st.sampled_from([256, 2048, 4096, 8192, 32768]) | st.integers(64, 131072)
partial = st.sampled_from([1.0, 0.5, 0.25])


def hf_config(head_dim, base, rope_parameters, max_position_embeddings, partial_rotary_factor=1.0):
    rope_parameters = {"rope_theta": base, **rope_parameters}
    if partial_rotary_factor != 1.0:
        rope_parameters["partial_rotary_factor"] = partial_rotary_factor
    return T.LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        head_dim=head_dim,
        num_hidden_layers=1,
        intermediate_size=8,
        vocab_size=8,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=rope_parameters,
    )


def hf(rope_type, config, seq_len=None):
    return ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)


def assert_same(ours, theirs, factor=None):
    """Bit-identical; at factor 1 rope-extend returns plain RoPE exactly where transformers' blend can be
    one float32 rounding off, so there it is equal to rounding."""
    (a, sa), (b, sb) = ours, theirs
    assert a.dtype == torch.float32 and a.shape == b.shape
    if factor == 1.0:
        torch.testing.assert_close(a, b.to(torch.float32), rtol=3e-7, atol=0)
    else:
        assert torch.equal(a, b.to(torch.float32)), (a - b).abs().max()
    assert sa == pytest.approx(sb, rel=1e-12, abs=0)


@settings(max_examples=60, deadline=None)
@given(head_dims, bases, factors, lengths, partial)
def test_linear(head_dim, base, factor, length, prf):
    config = hf_config(head_dim, base, {"rope_type": "linear", "factor": factor}, length, prf)
    assert_same(inv_freq("linear", head_dim, base, factor, length, partial_rotary_factor=prf), hf("linear", config))


@settings(max_examples=60, deadline=None)
@given(head_dims, bases, factors, lengths, st.floats(0.1, 40.0))
def test_dynamic_matches_transformers_when_max_position_is_the_original_length(head_dim, base, factor, length, ratio):
    # transformers' dynamic measures against max_position_embeddings; with that equal to L it is the spec.
    seq_len = max(1, int(length * ratio))
    config = hf_config(head_dim, base, {"rope_type": "dynamic", "factor": factor}, length)
    ours = inv_freq("dynamic", head_dim, base, factor, length, seq_len=seq_len)
    theirs = hf("dynamic", config, seq_len)
    torch.testing.assert_close(ours[0], theirs[0], rtol=2e-6, atol=0)
    assert ours[1] == theirs[1] == 1.0


yarn_params = st.fixed_dictionaries(
    {},
    optional={
        "beta_fast": st.sampled_from([16.0, 32.0, 64.0]),
        "beta_slow": st.sampled_from([0.5, 1.0, 2.0]),
        "attention_factor": st.floats(0.5, 2.0),
        "truncate": st.booleans(),
    },
)


@settings(max_examples=80, deadline=None)
@given(head_dims, bases, factors, lengths, partial, yarn_params)
def test_yarn(head_dim, base, factor, length, prf, params):
    config = hf_config(
        head_dim,
        base,
        {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": length, **params},
        int(length * factor),
        prf,
    )
    ours = inv_freq("yarn", head_dim, base, factor, length, partial_rotary_factor=prf, **params)
    assert_same(ours, hf("yarn", config), factor)


@settings(max_examples=30, deadline=None)
@given(head_dims, factors, st.floats(0.1, 2.0), st.floats(0.1, 2.0))
def test_yarn_deepseek_mscale(head_dim, factor, mscale, mscale_all_dim):
    params = {"mscale": mscale, "mscale_all_dim": mscale_all_dim}
    config = hf_config(
        head_dim,
        10000.0,
        {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": 4096, **params},
        int(4096 * factor),
    )
    assert_same(inv_freq("yarn", head_dim, 10000.0, factor, 4096, **params), hf("yarn", config), factor)
    expected = (
        1.0 if factor <= 1 else (0.1 * mscale * math.log(factor) + 1) / (0.1 * mscale_all_dim * math.log(factor) + 1)
    )
    assert inv_freq("yarn", head_dim, 10000.0, factor, 4096, **params)[1] == pytest.approx(expected)


@settings(max_examples=60, deadline=None)
@given(head_dims, bases, factors, lengths, st.sampled_from([(1.0, 4.0), (1.0, 2.0), (2.0, 8.0), (0.5, 4.0)]))
def test_llama3(head_dim, base, factor, length, low_high):
    low, high = low_high
    params = {"low_freq_factor": low, "high_freq_factor": high}
    config = hf_config(
        head_dim,
        base,
        {"rope_type": "llama3", "factor": factor, "original_max_position_embeddings": length, **params},
        int(length * factor) + 1,
    )
    assert_same(inv_freq("llama3", head_dim, base, factor, length, **params), hf("llama3", config), factor)


@settings(max_examples=40, deadline=None)
@given(head_dims, bases, factors, lengths, st.data())
def test_longrope_short_and_long(head_dim, base, factor, length, data):
    n = head_dim // 2
    short = data.draw(st.lists(st.floats(1.0, 4.0), min_size=n, max_size=n))
    long = data.draw(st.lists(st.floats(1.0, 64.0), min_size=n, max_size=n))
    params = {"short_factor": short, "long_factor": long}
    config = hf_config(
        head_dim,
        base,
        {"rope_type": "longrope", "factor": factor, "original_max_position_embeddings": length, **params},
        int(length * factor),
    )
    for seq_len in (None, length, length + 1, 4 * length):
        ours = inv_freq("longrope", head_dim, base, factor, length, seq_len=seq_len, **params)
        assert_same(ours, hf("longrope", config, seq_len))


def test_plain_rope_matches_the_models_default_buffer():
    from tests.tiny import tiny_model

    model = tiny_model("llama")
    ours, scale = inv_freq("linear", 16, 10000.0, 1.0, 256)
    assert torch.equal(ours, model.model.rotary_emb.inv_freq) and scale == 1.0
