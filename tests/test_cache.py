"""Dynamic methods with a KV cache: cached keys re-rotated when the frequencies change (rope_extend.hf.cache_keeper)."""

import pytest
import torch
import transformers as T

import rope_extend
from rope_extend import cache_kwargs
from rope_extend.hf import cache_keeper as C
from rope_extend.hf import rotary as R
from rope_extend.hf.reading import rotary_geometry, scaled_layer_types, text_config
from tests.tiny import tiny_config, tiny_model

L = 64  # tiny models trained at 64 tokens: 256 new tokens after a 40-token prompt cross L and 4L
METHODS = ["dynamic", "dynamic_yarn", "longrope"]


def patch(model, method):
    kwargs = {}
    if method == "longrope":
        config = text_config(model.config)
        dim, _ = rotary_geometry(config, scaled_layer_types(config)[0])
        half = dim // 2
        kwargs = {"short_factor": [1.0] * half, "long_factor": [1.0 + 3.0 * i / half for i in range(half)]}
    return rope_extend.patch(model, method, factor=4, **kwargs)


def without_keeper(model):
    for module in model.modules():
        for key, hook in list(module._forward_pre_hooks.items()):
            if isinstance(hook, C.CacheKeeper):
                C.remove(module, key)
    return model


def first_scaled_layer(model):
    config = text_config(model.config)
    types = getattr(config, "layer_types", None)
    if scaled_layer_types(config) == [None] or not types:
        return 0
    return next(i for i, t in enumerate(types) if t in scaled_layer_types(config))


@torch.no_grad()
def cached_keys(model, ids, chunks):
    """Keys of the first scaled layer after a prefill and decode steps of the given sizes, and of one uncached
    forward over the same tokens (whose keys all use the frequencies of the full length)."""
    out, start = None, 0
    for size in chunks:
        out = model(ids[:, start : start + size], **cache_kwargs(out.past_key_values if out else None), use_cache=True)
        start += size
    layer = first_scaled_layer(model)
    full = model(ids[:, :start], use_cache=True)
    return out.past_key_values.layers[layer].keys, full.past_key_values.layers[layer].keys


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family", ["llama", "gemma3", "phi", "cohere"])
def test_cached_keys_equal_the_keys_of_an_uncached_forward(family, method):
    """The first scaled layer sees the same inputs either way, so its cached keys, re-rotated at every change
    of frequencies, must equal the keys one forward computes at the final length (Gemma 3: global layers;
    Phi: partial rotary; Cohere: interleaved rotation)."""
    torch.manual_seed(0)
    ids = torch.randint(3, 500, (1, 4 * L + 20))
    chunks = [40] + [1] * (4 * L - 40) + [20]  # decoding across L, 2L, 4L, then 20 tokens at once
    if family == "gemma3" and method == "longrope" and R._LONGROPE_PER_LAYER_BUG:
        with pytest.raises(rope_extend.UnsupportedModelError, match="fixed in transformers 5.21"):
            patch(tiny_model(family, max_position_embeddings=L), method)
        return
    model = patch(tiny_model(family, max_position_embeddings=L), method)
    got, want = cached_keys(model, ids, chunks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got, want = cached_keys(without_keeper(model), ids, chunks)
    assert (got - want).abs().max() > 1e-3  # the comparison can fail: without re-rotation the keys are stale


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family", ["llama", "phi"])
def test_cached_greedy_generation_equals_uncached(family, method):
    """Over 256 new tokens that cross L and 4L: identical tokens, and logits far closer than without the
    re-rotation. They cannot be equal to rounding: the hidden states of earlier tokens were computed with the
    frequencies of their time (the uncached forward recomputes them all), which the re-rotation of keys
    cannot undo; measured: <= 7e-4 of the largest logit here, 10-30x less than without it."""
    prompt = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(1))

    def run(model, use_cache):
        with torch.no_grad():
            out = model.generate(
                prompt,
                do_sample=False,
                max_new_tokens=256,
                min_new_tokens=256,
                use_cache=use_cache,
                output_logits=True,
                return_dict_in_generate=True,
            )
        return out.sequences, torch.stack(out.logits)[:, 0]

    def gap(a, b):
        return ((a - b).abs().amax(-1) / b.abs().amax(-1)).max().item()

    model = patch(tiny_model(family, max_position_embeddings=L), method)
    (cached, cached_logits), (uncached, uncached_logits) = run(model, True), run(model, False)
    assert torch.equal(cached, uncached)
    with_keeper = gap(cached_logits, uncached_logits)
    assert with_keeper < 1e-3
    stale_tokens, stale_logits = run(without_keeper(model), True)
    n = int((stale_tokens == uncached).all(0).long().cumprod(0).sum())  # compare where the tokens still agree
    assert gap(stale_logits[: n - 40], uncached_logits[: n - 40]) > 5 * with_keeper


def test_left_padded_batches_use_one_length_per_batch():
    """Per-batch semantics: every row uses the frequencies of the batch's longest position, cached or not; the
    cached keys of every row (at its own, padded positions) equal those of one uncached forward."""
    model = patch(tiny_model("llama", max_position_embeddings=L), "dynamic")
    ids = torch.randint(3, 500, (2, 170), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :20], ids[1, :20] = 0, 0  # the second row is 20 tokens shorter, left-padded
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate computes them
    with torch.no_grad():
        out = model(ids[:, :50], attention_mask=mask[:, :50], position_ids=positions[:, :50], use_cache=True)
        for t in range(50, 170):
            out = model(
                ids[:, t : t + 1],
                attention_mask=mask[:, : t + 1],
                position_ids=positions[:, t : t + 1],
                **cache_kwargs(out.past_key_values),
                use_cache=True,
            )
        full = model(ids, attention_mask=mask, position_ids=positions, use_cache=True)
    got, want = out.past_key_values.layers[0].keys, full.past_key_values.layers[0].keys
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1, :, 20:], want[1, :, 20:], rtol=1e-5, atol=1e-5)  # the padding is masked
    assert next(iter(model.model.rotary_emb.forward.entries.values())).seen == 170  # the longest row's length


def test_static_cache_works_and_sliding_static_layers_are_refused():
    model = patch(tiny_model("llama", max_position_embeddings=L), "dynamic")
    prompt = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        kwargs = dict(do_sample=False, max_new_tokens=80, min_new_tokens=80)
        dynamic = model.generate(prompt, **kwargs)
        static = model.generate(prompt, cache_implementation="static", **kwargs)
    assert torch.equal(dynamic, static)

    windowed = patch(tiny_model("mistral", max_position_embeddings=L, sliding_window=32), "dynamic")
    cache = T.StaticCache(config=windowed.config, max_cache_len=128)
    assert any(type(layer).__name__ == "StaticSlidingWindowLayer" for layer in cache.layers)
    with pytest.raises(
        rope_extend.UnsupportedModelError, match="dynamic on mistral .*StaticSlidingWindowLayer cannot be re-rotated"
    ) as refused:
        windowed(prompt, **cache_kwargs(cache), use_cache=True)
    # the advice names the cache that would work, never the one given (it named "or a StaticCache" here)
    assert str(refused.value).endswith(
        "cannot be re-rotated; use a DynamicCache (generate's default), or a static method (yarn, ntk, linear)"
    )


def test_a_cache_is_never_advised_to_the_user_who_gave_it():
    """A layer the keeper cannot turn is refused with the caches whose layer of that type it could turn, other
    than the one given; where none is left, a static method or no cache. (The hybrids' DynamicCache was refused
    with "use a DynamicCache (generate's default)": their state layers are turned by no one and are skipped now,
    ``tests/families/test_cached_dynamic.py``.)"""
    from transformers import cache_utils as cu

    from rope_extend.hf import cache_keeper as keeper

    dynamic, static = T.DynamicCache(), T.StaticCache(config=tiny_model("llama").config, max_cache_len=8)
    assert keeper._alternatives(dynamic, "sliding_attention") == []  # a StaticCache's sliding layers cannot turn
    assert keeper._alternatives(static, "sliding_attention") == ["a DynamicCache (generate's default)"]
    assert keeper._alternatives(static, None) == ["a DynamicCache (generate's default)"]
    assert keeper._alternatives(object(), None) == ["a DynamicCache (generate's default)", "a StaticCache"]
    indexed = [t for t, c in cu.DYNAMIC_LAYER_TYPE_MAPPING.items() if "Indexed" in c.__name__]
    for layer_type in indexed:  # DeepSeek-V3.2's and Qwen's sparse attention: no cache of transformers turns
        assert keeper._alternatives(dynamic, layer_type) == []


def test_unpatch_removes_the_keeper_and_static_methods_install_none():
    model = patch(tiny_model("llama", max_position_embeddings=L), "dynamic_yarn")
    assert C.keepers(model.model)
    rope_extend.patch(model, "yarn", factor=4)  # replaces the dynamic patch
    assert not C.keepers(model.model)
    patch(model, "longrope")
    rope_extend.unpatch(model)
    assert not C.keepers(model.model) and not model.model._forward_pre_hooks


def test_a_config_naming_a_dynamic_type_gets_the_keeper():
    config = tiny_config(
        rope_parameters={
            "rope_type": "dynamic_yarn",
            "factor": 4.0,
            "original_max_position_embeddings": L,
            "rope_theta": 10000.0,
        },
        max_position_embeddings=4 * L,
    )
    model = T.LlamaForCausalLM(config).eval()
    assert len(C.keepers(model.model)) == 1
    ids = torch.randint(3, 500, (1, 3 * L))
    got, want = cached_keys(model, ids, [40] + [1] * (3 * L - 40))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


DECODE = [12] + [1] * 108  # a 12-token prompt, then one token at a time across L = 16, 32 ... 120


@pytest.mark.parametrize("family", ["glm", "helium", "gemma3_text"])
def test_cached_keys_are_re_rotated_in_the_family_convention(family):
    """Families that pair dimensions inside ``apply_rotary_pos_emb`` (GLM, Helium: interleaved, from cos/sin
    laid out in halves) and per-layer-type sets (Gemma 3), from tests.families' builds: the cached keys, re-rotated
    at every change of frequencies, equal the uncached forward's."""
    from tests.families.tiny import build

    model = build(family)
    rope_extend.patch(model, "dynamic", factor=8, original_max_position_embeddings=16)
    ids = torch.randint(3, 200, (1, 120), generator=torch.Generator().manual_seed(0))
    got, want = cached_keys(model, ids, DECODE)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cached_keys_of_nope_layers_are_left_alone():
    """SmolLM3's NoPE layers (``no_rope_layers`` 0; layer 0 here): their cached keys never turn."""
    config = T.SmolLM3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, no_rope_layers=[0, 1], pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = T.SmolLM3ForCausalLM(config).eval()
    rope_extend.patch(model, "dynamic", factor=8, original_max_position_embeddings=16)
    ids = torch.randint(3, 200, (1, 120), generator=torch.Generator().manual_seed(0))
    got, want = cached_keys(model, ids, DECODE)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_compressed_cache_is_refused_not_turned_wrong():
    """DeepSeek-V3 (MLA) caches keys of another size than its attention sees: re-rotation is refused clearly."""
    from tests.families.tiny import build

    model = build("deepseek_v3")
    rope_extend.patch(model, "dynamic", factor=8, original_max_position_embeddings=16)
    ids = torch.randint(3, 200, (1, 60), generator=torch.Generator().manual_seed(0))
    with pytest.raises(rope_extend.UnsupportedModelError, match="layer 0 caches keys of size .*compressed cache"):
        cached_keys(model, ids, DECODE[:49])
    # refused at the first forward with a cache, before it runs (not when the frequencies first change, after
    # forwards have filled the cache): the cache is left empty
    cache = T.DynamicCache(config=model.config)
    with pytest.raises(rope_extend.UnsupportedModelError, match="dynamic on deepseek_v3 .*compressed cache"):
        model(input_ids=ids[:, :8], use_cache=True, **rope_extend.cache_kwargs(cache))
    assert cache.get_seq_length() == 0
    with torch.no_grad():  # without a cache, the method runs
        assert model(input_ids=ids, use_cache=False).logits.isfinite().all()
