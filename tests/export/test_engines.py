"""Exports checked against the serving engines' own code (marker ``engines``; ``.ci/run`` runs them in a step
that installs llama-cpp-python and unpacks vLLM's and SGLang's rotary modules from their wheels).

- vLLM 0.33.0 and SGLang 0.5.23: the exported rope dict goes through the engine's ``get_rope``; its cos/sin
  cache must equal rope-extend's at every position up to 4 L.
- llama.cpp (llama-cpp-python 0.3.36): SmolLM2-135M patched and exported as GGUF; perplexity within 1% of the
  patched transformers model on the same token ids, and the same greedy continuation.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from rope_extend.export import configs, forms, routes
from rope_extend.methods import registry
from tests.export import engine_code

pytestmark = pytest.mark.engines

DIM, BASE, L, FACTOR = 64, 10000.0, 256, 4.0
# LongRoPE factors as a LongRoPE2 search leaves them (--space longrope2; head dimension 64, base 10000, L 256:
# critical dimension 26, pair 13 of 32):
# short all 1, long rising to s below the critical pair and within [s, 2 s] from it on
SEARCHED = {
    "short_factor": [1.0] * 32,
    "long_factor": [1.0 + 3 * i / 13 for i in range(13)] + [4.0 + i / 18 for i in range(19)],
}
CASES = [
    ("none", {}),
    ("linear", {}),
    ("ntk", {}),
    ("ntk_by_parts", {}),
    ("yarn", {}),
    ("yarn", {"attention_factor": 1.3, "beta_fast": 16.0, "beta_slow": 2.0}),
    ("yarn", {"truncate": False}),
    ("llama3", {}),
    ("dynamic", {}),
    ("dynamic_yarn", {}),
    ("longrope", {"short_factor": [1.0 + i / 64 for i in range(32)], "long_factor": [1.0 + i / 8 for i in range(32)]}),
    ("longrope", SEARCHED),  # what `search` writes: the original rope up to L
    ("longrope", {**SEARCHED, "attention_factor": 1.0}),  # the mixed-window recipe's: scale 1 at every length
]


def scaling_for(name, params):
    if name == "none":
        return None
    return registry.resolve(registry.get(name), factor=FACTOR, original_max_position_embeddings=L, params=params)


def expected_cache(scaling, positions: int) -> torch.Tensor:
    """rope-extend's cos/sin (times the attention scale) at positions 0..positions-1, at the target length (for
    ``dynamic``, the patched model's: at the target rounded up to its grid, ``forms.patched_length``)."""
    if scaling is None:
        freqs, scale = registry.inv_freq("linear", DIM, BASE, 1.0, L)
    elif scaling.method.name == "dynamic":
        freqs, scale = scaling.compute(DIM, BASE, forms.patched_length(scaling))
    else:
        freqs, scale = scaling.compute(DIM, BASE, max(positions, L + 1))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), freqs)
    return torch.cat([angles.cos() * scale, angles.sin() * scale], dim=-1)


def exported(name, params, target):
    scaling = scaling_for(name, params)
    decision = routes.decide(scaling, target, DIM, BASE)
    assert decision.status in (routes.EXPORTED, routes.APPROXIMATE)
    length = scaling.target_length if scaling is not None else L
    return scaling, configs.config_updates(decision.form, length, target), length


def compare(cache: torch.Tensor, scaling, upto: int) -> float:
    want = expected_cache(scaling, upto)
    got = cache[:upto, : want.shape[1]].float()
    return float((got - want).abs().max())


@pytest.mark.skipif(not engine_code.available(engine_code.VLLM), reason="vLLM's rotary files are not unpacked")
@pytest.mark.parametrize(("name", "params"), CASES)
def test_vllm_get_rope_computes_the_same_cos_sin(name, params):
    rotary = engine_code.vllm_rotary()
    scaling, updates, length = exported(name, params, "vllm")
    engine_code._VllmConfig.model_config.max_model_len = length  # the serve command's --max-model-len
    rope = rotary.get_rope(DIM, updates["max_position_embeddings"], True, updates["rope_parameters"], torch.float32)
    # LongRoPE: the long half of its cache, used for every sequence when serving past L
    cache = rope.long_short_cos_sin_cache[L:] if name == "longrope" else rope.cos_sin_cache
    upto = 4 * L if scaling is not None else L
    assert cache.shape[0] >= upto  # it serves the target
    assert compare(cache, scaling, upto) < 2e-4


@pytest.mark.skipif(not engine_code.available(engine_code.SGLANG), reason="SGLang's rotary files are not unpacked")
@pytest.mark.parametrize(("name", "params"), CASES)
def test_sglang_get_rope_computes_the_same_cos_sin(name, params):
    rotary = engine_code.sglang_rotary()
    scaling, updates, _length = exported(name, params, "sglang")
    rope_params = dict(updates["rope_parameters"])
    base = rope_params.pop("rope_theta")
    rope = rotary.get_rope(DIM, DIM, updates["max_position_embeddings"], base, True, rope_params, dtype=torch.float32)
    cache = rope.long_short_cos_sin_cache[L:] if name == "longrope" else rope.cos_sin_cache
    upto = 4 * L if scaling is not None else L
    assert cache.shape[0] >= upto
    assert compare(cache, scaling, upto) < 2e-4


@pytest.mark.skipif(
    not engine_code.available(engine_code.TRANSFORMERS4), reason="transformers 4.57.1's rope file is not unpacked"
)
@pytest.mark.parametrize("params", [CASES[-3][1], SEARCHED, {**SEARCHED, "attention_factor": 1.0}])
def test_transformers4_longrope_switches_at_L_with_rope_extends_numbers(params):
    """A longrope ``transformers4`` export read by transformers 4.57.1's own rope code (``_compute_longrope_parameters``
    and ``dynamic_rope_update``, around a rotary module's state as its ``LlamaRotaryEmbedding.__init__`` sets it):
    the short factors up to L, the long ones past it, and LongRoPE's scale, as rope-extend's longrope at each
    length. Without ``original_max_position_embeddings`` at the config's top level, transformers 4 takes the
    target as L: short factors at every length, and scale 1 where it is not given."""
    tf4 = engine_code.transformers4_rope()
    scaling, updates, length = exported("longrope", params, "transformers4")
    config = types.SimpleNamespace(hidden_size=DIM * 2, num_attention_heads=2, head_dim=DIM, **updates)

    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config, self.rope_type = config, config.rope_scaling["rope_type"]
            self.rope_init_fn = tf4.ROPE_INIT_FUNCTIONS[self.rope_type]
            inv_freq, self.attention_scaling = self.rope_init_fn(config, "cpu")
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            self.original_inv_freq = self.inv_freq

        @tf4.dynamic_rope_update
        def forward(self, x, position_ids):
            return self.inv_freq, self.attention_scaling

    rotary = Rotary()
    for n in (L - 1, L, L + 1, length):
        got, scale = rotary(torch.zeros(1), torch.arange(n)[None])
        want, want_scale = scaling.compute(DIM, BASE, n)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=f"inverse frequencies at {n} tokens")
        assert scale == pytest.approx(want_scale, rel=1e-9), n


@pytest.mark.real_model
@pytest.mark.parametrize("spec", ["none", "linear:2", "yarn:2", "llama3:2"])
def test_llama_cpp_matches_the_patched_model(tmp_path, spec):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    from eval.serving_parity import measure
    from tests.export.smollm2 import model_and_text

    model, tokenizer, text = model_and_text()
    ids = tokenizer(text)["input_ids"][:1024]
    row = measure(spec, model, tokenizer, ids, 16, 2, tmp_path)
    assert row["ppl_rel_diff"] < 0.01, row
    assert row["greedy_identical"], row
    assert np.isfinite(row["logprob_max_abs_diff"]) and row["logprob_max_abs_diff"] < 0.1, row


TOKENIZER_TEXT = (
    "The river keeps 12,345.67 of its own time!!  Twice   over   42,  7 and\t\t9\n\n\tand again:  'twas done; don't, we'll ok?\n"
    "Übergrößen café naïve — “quotes” 北京 123abc x2y3 ١٢٣ ² ½ $100 #tag 🙂 3.14159e-10 \r\n   trailing   "
)


@pytest.mark.parametrize("pre", [None, "gemma4"])
def test_llama_cpp_splits_the_bundled_tokenizer_as_transformers_does(tmp_path, pre):
    """The bundled model exports to GGUF without --tokenizer-pre: ``smollm`` (llama.cpp splits every digit, then
    GPT-2's regex), which is its tokenizer.json's ``Digits(individual_digits)`` then byte-level ``ByteLevel``; llama.cpp
    tokenizes a text with digit runs, punctuation, whitespace runs and non-ASCII letters to the ids transformers
    gives. The control: ``gemma4`` (no byte-level split) gives other ids, so the comparison can fail. (Most other
    byte-level pre-tokenizers give the same ids on this vocabulary: none of its 765 merges joins a letter to a
    digit, a space or punctuation, so splitting there changes nothing.)"""
    llama_cpp = pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    from rope_extend.export import export
    from rope_extend.loading import load_tokenizer, resolve_name

    export("bundled", "gguf", tmp_path / "b.gguf", tokenizer_pre=pre)
    want = load_tokenizer(resolve_name("bundled"))(TOKENIZER_TEXT, add_special_tokens=False).input_ids
    vocab = llama_cpp.Llama(str(tmp_path / "b.gguf"), vocab_only=True, verbose=False)
    got = vocab.tokenize(TOKENIZER_TEXT.encode("utf-8"), add_bos=False, special=False)
    assert (got == want) == (pre is None), (pre, got[:40], want[:40])
    if pre is None:  # the defaults agree too: no BOS on either side
        assert vocab.tokenize(b"x 12") == load_tokenizer(resolve_name("bundled"))("x 12").input_ids
