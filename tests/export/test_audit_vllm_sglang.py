"""The audit's model of vLLM 0.33.0 and SGLang 0.5.23 checked against the engines' own rotary code (marker
``engines``; the rotary modules unpacked from the wheels, run on the CPU by ``tests/export/engine_code.py``).

For each rope dict the audit handles, the config is read as the audit reads it (``reference.load``) and handed to
the engine's ``get_rope`` the way its model code hands it (vLLM's ``models/llama.py``: ``get_rope(head_dim,
max_position_embeddings, rope_parameters=config.rope_parameters)``, ``gemma3.py`` one dict per layer type;
SGLang's ``models/llama.py``: ``get_rope(head_dim, rotary_dim, max_position_embeddings, base=rope_theta,
rope_scaling=config.rope_parameters)``). The engine's module then rotates a probe query (each rotated pair
``(1, 0)``) at positions ``0..served-1`` through its own forward, so its own choice of cache rows (LongRoPE's
short/long switch included) is what is measured: the rotated probe is ``s (cos p f, sin p f)``; ``s`` is its norm
and ``f`` the slope of its unwrapped phase over the positions. Both must equal what ``vllm_sglang.layers`` says the
engine computes within ``RTOL`` (relative).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rope_extend.errors import RopeExtendError
from rope_extend.export.audit import reference, vllm_sglang
from tests.export import engine_code

pytestmark = pytest.mark.engines

RTOL = 1e-5
HEAD, L = 64, 256  # head_dim 64 (32 frequencies), original context 256
SHORT = [1.0 + i / 64 for i in range(HEAD // 2)]
LONG = [1.0 + i / 4 for i in range(HEAD // 2)]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L, "rope_theta": 10000.0}
LONGROPE = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": L}
ROOTS = {"vllm": engine_code.VLLM, "sglang": engine_code.SGLANG}

# (id, rope dict, max_position_embeddings, served lengths (None: the longest the engine serves))
CASES = [
    ("default", {"rope_type": "default", "rope_theta": 10000.0}, L, [None]),
    ("default-theta", {"rope_type": "default", "rope_theta": 500000.0}, 4 * L, [None]),
    ("linear", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, L, [None]),
    ("dynamic", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, L, [None]),
    ("dynamic-x4", {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 500000.0}, L, [None]),
    ("yarn", YARN, 4 * L, [None]),
    (
        "yarn-betas-attention_factor",
        {**YARN, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.3},
        4 * L,
        [None],
    ),
    ("yarn-attention_factor-only", {**YARN, "attention_factor": 1.5}, 4 * L, [None]),  # vLLM's keys only
    ("yarn-attn_factor", {**YARN, "attn_factor": 1.2}, 4 * L, [None]),  # SGLang's multiplier
    ("yarn-truncate-false", {**YARN, "factor": 32.0, "rope_theta": 150000.0, "truncate": False}, 32 * L, [None]),
    ("yarn-truncate-missing", {**YARN, "factor": 32.0, "rope_theta": 150000.0}, 32 * L, [None]),  # GPT-OSS planted
    ("yarn-mscale", {**YARN, "mscale": 1.0, "mscale_all_dim": 0.8}, 4 * L, [None]),
    ("yarn-mscale-all-dim-zero", {**YARN, "mscale": 0.7, "mscale_all_dim": 0.0}, 4 * L, [None]),
    ("yarn-lost-original", {k: v for k, v in YARN.items() if k != "original_max_position_embeddings"}, 4 * L, [None]),
    ("yarn-as-linear", {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, L, [None]),  # planted
    (
        "llama3",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": L,
            "rope_theta": 500000.0,
        },
        8 * L,
        [None],
    ),
    ("longrope", {**LONGROPE, "rope_theta": 10000.0}, 4 * L, [L - 1, L, L + 1, L + 2, 4 * L]),
    (
        "longrope-mscales",
        {**LONGROPE, "short_mscale": 1.05, "long_mscale": 1.2, "rope_theta": 10000.0},
        4 * L,
        [L, 4 * L],
    ),
    # rope-extend's transformers export writes attention_factor; the engines read short_mscale / long_mscale only
    ("longrope-attention_factor", {**LONGROPE, "attention_factor": 1.3, "rope_theta": 10000.0}, 4 * L, [L, 4 * L]),
    # a factor other than max_position_embeddings / original: transformers' default scale follows the factor
    ("longrope-factor", {**LONGROPE, "factor": 2.0, "rope_theta": 10000.0}, 4 * L, [L, 4 * L]),
]


def folder(tmp_path, rope: dict, max_positions: int, model_type: str = "llama", **extra):
    config = {
        "model_type": model_type,
        "vocab_size": 64,
        "hidden_size": 4 * HEAD,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": HEAD,
        "num_hidden_layers": 2,
        "max_position_embeddings": max_positions,
        "rope_parameters": rope,
        **extra,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def build(engine: str, params: dict, max_positions: int, served: int):
    """The engine's rotary module for one layer's rope dict, as its Llama model code builds it."""
    if engine == "vllm":
        engine_code._VllmConfig.model_config.max_model_len = served  # --max-model-len
        rotary = engine_code.vllm_rotary()
        return rotary.get_rope(HEAD, max_positions, True, dict(params), torch.float32)
    rotary = engine_code.sglang_rotary()
    return rotary.get_rope(
        HEAD, HEAD, max_positions, params.get("rope_theta", 10000), True, dict(params), torch.float32
    )


def rows(rope) -> int:
    """How many positions the engine's table holds (LongRoPE: its short and long halves are indexed apart)."""
    cache = getattr(rope, "cos_sin_cache", None)
    return rope.max_position_embeddings if cache is None else cache.shape[0]


def measured(rope, served: int) -> tuple[np.ndarray, float]:
    """``(frequencies, scale)`` the engine's forward applies to the positions ``0..served-1`` of one sequence."""
    half = HEAD // 2
    positions = torch.arange(served)
    probe = torch.cat([torch.ones(served, half), torch.zeros(served, half)], dim=-1)
    q, _k = rope(positions, probe.clone(), probe.clone())
    q = q.reshape(served, HEAD).double().numpy()
    cos, sin = q[:, :half], q[:, half:]
    phase = np.unwrap(np.arctan2(sin, cos), axis=0)
    p = np.arange(served, dtype=np.float64)[:, None]
    return (p * phase).sum(axis=0) / (p * p).sum(), float(np.hypot(cos, sin).mean())


def check(engine: str, config, served: int, params_of=None, table_short: bool = False) -> list[str]:
    """Assert that the audit's frequencies and scale for each layer type of ``config`` served at ``served`` tokens
    are those the engine's forward applies; returns the audit's notes. ``params_of(layer_type)``: the dict the
    engine's model code hands ``get_rope`` (by default the config's own). ``table_short``: the engine's table is
    expected to hold fewer than ``served`` positions (then the positions it holds are measured)."""
    params_of = params_of or (lambda kind: reference.rope_params(config, kind))
    layers, notes = vllm_sglang.layers(config, engine, served)
    seen = set()
    for kind, want in layers:
        if kind in seen:
            continue
        seen.add(kind)
        rope = build(engine, params_of(kind), int(config.max_position_embeddings), served)
        assert (rows(rope) < served) == table_short, (kind, rows(rope), served)
        got_freqs, got_scale = measured(rope, min(served, rows(rope)))
        assert got_freqs.shape == want.freqs.shape
        worst = float(np.max(np.abs(got_freqs / want.freqs - 1.0)))
        assert worst < RTOL, (kind, served, worst, got_freqs, want.freqs)
        assert abs(got_scale / want.scale - 1.0) < RTOL, (kind, served, got_scale, want.scale)
    return notes


def needs(engine: str):
    if not engine_code.available(ROOTS[engine]):
        pytest.skip(f"{engine}'s rotary files are not unpacked")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize(("name", "rope", "max_positions", "lengths"), CASES, ids=[c[0] for c in CASES])
def test_audit_computes_what_the_engine_computes(tmp_path, engine, name, rope, max_positions, lengths):
    needs(engine)
    config = reference.load(folder(tmp_path, rope, max_positions))
    for length in lengths:
        served = length or vllm_sglang.longest(config, engine)
        if engine == "sglang" and name.startswith("longrope") and served == L + 1:
            continue  # position L rotated by angle 0: test_sglang_longrope_position_original_is_not_rotated
        short = name.startswith("dynamic") and engine == "vllm"  # vLLM serves factor x N from a table of N rows
        notes = " ".join(check(engine, config, served, table_short=short))
        if short:
            assert "plain RoPE" in notes and f"positions past {max_positions} have no rotary entries" in notes, notes
        if name.startswith("longrope"):  # each engine's own switch: vLLM by --max-model-len, SGLang by position
            long = served > L if engine == "vllm" else served - 1 > L
            assert ("long factors for every sequence" in notes) == long, (served, notes)


def test_the_measurement_can_fail(tmp_path):
    """The same engine module measured against the audit of another dict (yarn with truncate against without):
    the frequencies inside the ramp differ, and the check says so."""
    needs("vllm")
    config = reference.load(folder(tmp_path, {**YARN, "truncate": False}, 4 * L))
    with pytest.raises(AssertionError):
        check("vllm", config, 4 * L, lambda kind: {**YARN})
    with pytest.raises(AssertionError):  # and the scale: attention_factor 1.3 measured against the default
        check("vllm", config, 4 * L, lambda kind: {**YARN, "truncate": False, "attention_factor": 1.3})


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_an_integer_linear_factor_stops_the_engine_and_the_audit_says_so(tmp_path, engine):
    needs(engine)
    rope = {"rope_type": "linear", "factor": 2, "rope_theta": 10000.0}
    config = reference.load(folder(tmp_path, rope, L))
    with pytest.raises(TypeError, match="not iterable"):
        build(engine, reference.rope_params(config, None), L, 2 * L)
    with pytest.raises(RopeExtendError, match="factor 2 is an integer"):
        vllm_sglang.layers(config, engine, 2 * L)


def gemma3(tmp_path, local: dict):
    types = ["sliding_attention", "full_attention"] * 2
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_theta": 10000.0, **local},
    }
    extra = {"num_hidden_layers": 4, "layer_types": types, "sliding_window": 128}
    return reference.load(folder(tmp_path, rope, 8 * L, model_type="gemma3_text", **extra))


@pytest.mark.parametrize("local", [{"rope_type": "default"}, {"rope_type": "linear", "factor": 8.0}])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_gemma3_per_layer_type(tmp_path, engine, local):
    """vLLM's ``models/gemma3.py`` hands ``get_rope`` each layer type's own dict (the planted error's linear factor
    on local layers included); SGLang's ``models/gemma3_causal.py`` keeps local layers at plain RoPE with their
    ``rope_theta``, whatever their dict says."""
    needs(engine)
    config = gemma3(tmp_path, local)

    def params_of(kind):
        params = reference.rope_params(config, kind)
        if engine == "sglang" and kind == "sliding_attention":
            return {"rope_type": "default", "rope_theta": params["rope_theta"]}
        return params

    notes = " ".join(check(engine, config, 8 * L, params_of))
    assert ("keeps sliding_attention layers at plain RoPE" in notes) == (engine == "sglang" and "factor" in local)


def test_sglang_longrope_position_original_is_not_rotated(tmp_path):
    """SGLang's LongRoPE forward takes the long table only for positions past the original length ``k``; at
    position ``k`` itself (the largest of its batch: a sequence of ``k + 1`` tokens, or a decode step reaching it)
    it reads row ``k`` of the table, the long half's row 0, so the probe there comes back as at position 0. The
    other positions are the short factors, as the audit says, and the audit warns."""
    needs("sglang")
    config = reference.load(folder(tmp_path, {**LONGROPE, "rope_theta": 10000.0}, 4 * L))
    rope = build("sglang", reference.rope_params(config, None), 4 * L, L + 1)
    probe = torch.cat([torch.ones(L + 1, HEAD // 2), torch.zeros(L + 1, HEAD // 2)], dim=-1)
    q, _k = rope(torch.arange(L + 1), probe.clone(), probe.clone())
    assert torch.equal(q[L], q[0]) and not torch.allclose(q[L - 1], q[0])
    (_kind, want), *_ = vllm_sglang.layers(config, "sglang", L)[0]
    freqs, scale = measured(rope, L)  # the same module, positions 0..L-1: the short factors
    assert np.max(np.abs(freqs / want.freqs - 1)) < RTOL and abs(scale / want.scale - 1) < RTOL
    notes = " ".join(vllm_sglang.layers(config, "sglang", L + 1)[1])
    assert f"rotates position {L} by angle 0" in notes and f"short factors up to {L + 1} tokens" in notes, notes
    q2, _k = rope(torch.arange(L + 2), *[torch.ones(L + 2, HEAD // 2).repeat(1, 2)] * 2)
    assert not torch.allclose(q2[L], q2[0])  # one position more: the long table, position L rotated
