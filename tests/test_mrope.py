"""Attention methods on M-RoPE models (``rope_extend.hf.mrope``): exact on text positions, image tokens refused.

Tiny random models of transformers' own classes (``tests.families.tiny.build``): Qwen2.5-VL (contiguous sections),
Qwen3-VL (interleaved sections), Qwen3.5 (interleaved, partial rotary, linear-attention layers) and GLM-4V-MoE
(its layers pass the three axes to the attention function as ``position_ids``). Text-only logits are checked
against the explicit position-matrix reference of the families test (each pair at the method's ``rel(i, j)``,
written out from methods.md); generation with the cache against generation without it, and each left-padded row
against the row alone; an image prompt, and a cache the patch did not fill, are refused before a layer runs.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache

import rope_extend
from rope_extend import UnsupportedModelError
from rope_extend.hf import mrope
from rope_extend.hf.layout import decoder_of
from tests.families.tiny import build, tiny_config

N = 100  # tokens: past every method's window (16), Dual Chunk's chunks (40 positions each)
L = 32  # the original length for log-n (the tiny configs say 128, past N)
METHODS = {  # the families test's parameters, and Leaky ReRoPE's
    "self_extend": dict(group_size=4, window=16),
    "dual_chunk": dict(chunk_size=48, local_window=8),
    "rerope": dict(window=16),
    "leaky_rerope": dict(window=16, k=4.0),
    "string": dict(shifted_offset=32, local_window=8),
}
TOLERANCE = 1e-5  # of the largest logit; float32 measures 1e-7 to 6e-7
GENERATE = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
# what forwards, generate and their outputs call the KV cache: ``cache`` since transformers 5.24
CACHE = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"


def _ids(n: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 200, (batch, n), generator=torch.Generator().manual_seed(seed))


def _logits(model, **inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits.float()


def _image_inputs(model_type: str) -> dict:
    """Text, one image of 4 x 6 patches (6 tokens after the 2 x 2 merge: time 6, heights 6-7, widths 6-8), text."""
    config = tiny_config(model_type)
    vision = config.vision_config
    grid = torch.tensor([[1, 4, 6]])
    tokens = int(grid.prod()) // vision.spatial_merge_size**2
    image = torch.tensor([[config.vision_start_token_id] + [config.image_token_id] * tokens])
    ids = torch.cat([_ids(5), image, _ids(8, seed=2)], 1)
    pixels = torch.randn(int(grid.prod()), vision.in_channels * vision.temporal_patch_size * vision.patch_size**2)
    kinds = (ids == config.image_token_id).int()  # text 0, image 1: what the processor returns
    return dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=kinds)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "glm4v_moe"])
def test_text_logits_equal_the_explicit_reference(model_type):
    """Text-only input: every axis at the token's index, so each method is exact against its 1-D rule, and
    changes the logits (the method acts)."""
    # imported here: importing the families test lists every family of the registry (seconds), for its parameters
    from tests.families.test_attention_families import _reference_logits

    model, x = build(model_type), _ids(N)
    plain = _logits(model, input_ids=x)
    for method, params in METHODS.items():
        rope_extend.patch(model, method, **params)
        got = _logits(model, input_ids=x)
        want = _reference_logits(model, method, params, x, logn=False)
        scale = float(want.abs().max())
        assert float((got - want).abs().max()) / scale < TOLERANCE, method
        assert float((got - plain).abs().max()) / scale > 1e-3, method
    rope_extend.patch(model, "linear", factor=1, logn=True, original_max_position_embeddings=L)  # log-n alone
    got = _logits(model, input_ids=x)
    want = _reference_logits(model, "none", {}, x, logn=True)
    assert float((got - want).abs().max()) / float(want.abs().max()) < TOLERANCE
    rope_extend.unpatch(model)
    assert torch.equal(_logits(model, input_ids=x), plain)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "glm4v_moe"])
def test_left_padded_rows_equal_the_rows_alone(model_type):
    """Explicit 2-D position ids, left padding: Qwen2.5-VL's layers then pass no position_ids to the attention
    function, GLM-4V-MoE's pass the three axes; the methods read the rotary's, so the padded row is exact."""
    model = build(model_type)
    rope_extend.patch(model, "self_extend", **METHODS["self_extend"])
    x = torch.cat([_ids(60), torch.cat([torch.zeros(1, 7, dtype=torch.long), _ids(53, seed=2)], 1)])
    mask = torch.ones_like(x)
    mask[1, :7] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate gives them
    got = _logits(model, input_ids=x, attention_mask=mask, position_ids=positions)
    alone = _logits(model, input_ids=_ids(53, seed=2))
    assert float((got[1, 7:] - alone[0]).abs().max()) / float(alone.abs().max()) < TOLERANCE


def _scores(out) -> torch.Tensor:
    """The raw logits of each generated token, ``[batch, steps, vocabulary]``."""
    return torch.stack(out.logits, 1).float()


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("method", ["self_extend", "dual_chunk"])
def test_generation_with_the_cache_equals_without_and_padded_rows_equal_alone(model_type, method):
    """generate on a left-padded batch (its 4-row position ids: text row and three axes): the cached greedy
    tokens and their logits equal the uncached ones, and the padded row generates what it does alone."""
    model = build(model_type)
    rope_extend.patch(model, method, **METHODS[method])
    long, short = _ids(40, seed=3), _ids(33, seed=4)
    x = torch.cat([long, torch.cat([torch.zeros(1, 7, dtype=torch.long), short], 1)])
    mask = torch.ones_like(x)
    mask[1, :7] = 0
    kw = dict(GENERATE, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        cached = model.generate(input_ids=x, attention_mask=mask, **kw)
        uncached = model.generate(input_ids=x, attention_mask=mask, use_cache=False, **kw)
        alone = model.generate(input_ids=short, **kw)
    assert torch.equal(cached.sequences, uncached.sequences)
    scale = float(_scores(uncached).abs().max())
    assert float((_scores(cached) - _scores(uncached)).abs().max()) / scale < TOLERANCE
    assert torch.equal(cached.sequences[1, 7:], alone.sequences[0])
    assert float((_scores(cached)[1] - _scores(alone)[0]).abs().max()) / scale < TOLERANCE


def test_qwen3_5_cached_generation_equals_uncached():
    """Qwen3.5: linear-attention layers between the method's layers, partial interleaved M-RoPE."""
    model = build("qwen3_5")
    rope_extend.patch(model, "self_extend", **METHODS["self_extend"])
    kw = dict(GENERATE, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        cached = model.generate(input_ids=_ids(24, seed=3), **kw)
        uncached = model.generate(input_ids=_ids(24, seed=3), use_cache=False, **kw)
    assert torch.equal(cached.sequences, uncached.sequences)
    scale = float(_scores(uncached).abs().max())
    assert float((_scores(cached) - _scores(uncached)).abs().max()) / scale < TOLERANCE


def test_continuing_from_a_returned_cache_equals_one_uncached_run():
    """A second generate on the cache the first returned (its length is the one the patch recorded)."""
    model = build("qwen2_5_vl")
    rope_extend.patch(model, "self_extend", **METHODS["self_extend"])
    with torch.no_grad():
        first = model.generate(input_ids=_ids(30, seed=3), return_dict_in_generate=True, **GENERATE)
        more = torch.cat([first.sequences, _ids(6, seed=5)], 1)
        cached = model.generate(input_ids=more, **{CACHE: getattr(first, CACHE)}, **GENERATE)
        uncached = model.generate(input_ids=more, use_cache=False, **GENERATE)
    assert cached.shape[1] == 60 > 16 + 4 * 4  # past self_extend's window and groups
    assert torch.equal(cached, uncached)


def test_prompt_lookup_decoding_crops_the_cache_and_equals_greedy(monkeypatch):
    """Prompt-lookup decoding crops the cache when a guess is rejected: shorter than recorded, under the same
    patch, so accepted; its tokens equal uncached greedy decoding."""
    crops = []
    real = DynamicCache.crop
    monkeypatch.setattr(DynamicCache, "crop", lambda self, length: crops.append(length) or real(self, length))
    model = build("qwen2_5_vl")
    rope_extend.patch(model, "self_extend", **METHODS["self_extend"])
    x = torch.randint(3, 30, (1, 40), generator=torch.Generator().manual_seed(0))  # 27 ids: the prompt repeats
    with torch.no_grad():
        guessed = model.generate(input_ids=x, prompt_lookup_num_tokens=3, **GENERATE)
        uncached = model.generate(input_ids=x, use_cache=False, **GENERATE)
    assert crops
    assert torch.equal(guessed, uncached)


def test_forwards_on_the_cache_the_decoder_made_equal_one_forward():
    """The cache a forward made itself (``use_cache=True``, none given) is recorded too: the next forward on it
    runs, and equals one forward over both parts."""
    model = build("qwen2_5_vl")
    rope_extend.patch(model, "self_extend", **METHODS["self_extend"])
    x = _ids(50)
    with torch.no_grad():
        first = model(input_ids=x[:, :40], use_cache=True)
        second = model(input_ids=x[:, 40:], **{CACHE: getattr(first, CACHE)}, use_cache=True).logits
    whole = _logits(model, input_ids=x)
    assert float((second - whole[:, 40:]).abs().max()) / float(whole.abs().max()) < TOLERANCE


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_image_input_is_refused_before_a_layer_runs(model_type):
    """Image tokens have distinct time, height and width positions: refused at the rotary, before any layer
    writes its keys into the cache; log-n alone too. Text-only forwards run after it."""
    model = build(model_type)
    inputs = _image_inputs(model_type)
    rope_extend.patch(model, "self_extend", **METHODS["self_extend"])
    cache = DynamicCache()
    why = "image and video tokens have distinct temporal, height and width positions .* text-only inputs"
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match=f"^self_extend on {model_type}: {why}"):
        model.generate(**inputs, **{CACHE: cache}, **GENERATE)
    assert cache.get_seq_length() == 0
    rope_extend.patch(model, "yarn", factor=2, logn=True)
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match=rf"^log-n \(with yarn\) on {model_type}: image"):
        model(**inputs)
    assert torch.isfinite(_logits(model, input_ids=_ids(20))).all()


def test_a_cache_filled_by_the_unpatched_model_is_refused():
    """An image prompt run unpatched, then decoded patched: its cached image keys (and the text shifted by
    rope_deltas) cannot be told from text, so the patched forward refuses that cache."""
    model = build("qwen2_5_vl")
    inputs = _image_inputs("qwen2_5_vl")
    with torch.no_grad():
        out = model(**inputs, use_cache=True)
    cache = getattr(out, CACHE)
    assert model.model.rope_deltas.item() == -3  # 6 image tokens on 3 positions
    rope_extend.patch(model, "dual_chunk", **METHODS["dual_chunk"])
    step = out.logits[:, -1:].argmax(-1)
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match="the KV cache holds 20 tokens that this patched"):
        model(input_ids=step, **{CACHE: cache}, use_cache=True)
    assert cache.get_seq_length() == 20
    with torch.no_grad():  # a text cache the patch filled, then unpatched and patched again: not seen by this patch
        out = model(input_ids=_ids(30), use_cache=True)
        rope_extend.unpatch(model)
        rope_extend.patch(model, "dual_chunk", **METHODS["dual_chunk"])
        with pytest.raises(UnsupportedModelError, match="the KV cache holds 30 tokens"):
            model(input_ids=step, **{CACHE: getattr(out, CACHE)}, use_cache=True)


def test_positions_below_zero_are_refused():
    """After an image prompt, Qwen2.5-VL shifts a forward on embeddings alone by its stored rope_deltas (-3):
    its first text tokens land below position 0, which the methods would take for padding."""
    model = build("qwen2_5_vl")
    with torch.no_grad():
        model(**_image_inputs("qwen2_5_vl"))
    rope_extend.patch(model, "rerope", **METHODS["rerope"])
    embeds = model.get_input_embeddings()(_ids(20))
    why = "^rerope on qwen2_5_vl: a token's M-RoPE position is below 0"
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match=why):
        model(inputs_embeds=embeds)


def test_unpatch_removes_the_guard():
    model = build("qwen2_5_vl")
    inputs = _image_inputs("qwen2_5_vl")
    before = _logits(model, **inputs)
    rope_extend.patch(model, "string", **METHODS["string"])
    decoder = decoder_of(model)
    hooked = [m for m in model.modules() if m._forward_pre_hooks or m._forward_hooks]
    assert hooked and mrope.GUARD_ATTR in decoder.__dict__
    rope_extend.unpatch(model)
    assert not [m for m in model.modules() if m._forward_pre_hooks or m._forward_hooks]
    assert not [m for m in model.modules() if mrope.GUARD_ATTR in m.__dict__]
    assert torch.equal(_logits(model, **inputs), before)


@pytest.mark.parametrize("implementation", ["eager", "flex_attention"])
def test_eager_and_flex_models_equal_the_sdpa_model(implementation):
    """GLM-4V-MoE (transformers lets it load with FlexAttention; Qwen2.5-VL, Qwen3-VL and Qwen3.5 not): a
    left-padded batch with generate's position ids, as the sdpa model gives it."""
    x = _ids(60, batch=2)
    mask = torch.ones_like(x)
    mask[1, :7] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    out = {}
    for name in ("sdpa", implementation):
        model = build("glm4v_moe", attn_implementation=name)
        assert model.config.get_text_config()._attn_implementation == name
        rope_extend.patch(model, "self_extend", **METHODS["self_extend"])
        out[name] = _logits(model, input_ids=x, attention_mask=mask, position_ids=positions)
    got, want = out[implementation], out["sdpa"]
    assert float((got[0] - want[0]).abs().max()) < 1e-5
    assert float((got[1, 7:] - want[1, 7:]).abs().max()) < 1e-5


def test_dynamic_frequencies_with_the_cache_exact_on_text_refused_on_images():
    """A frequency method, for comparison: dynamic frequencies re-rotate the cached keys when they change, by one
    position per key. Text: cached greedy past L equals uncached. An image prompt with a cache is refused before
    a layer runs (its tokens' positions differ per axis); without the cache it runs."""
    model = build("qwen2_5_vl")
    rope_extend.patch(model, "dynamic", factor=4)
    kw = dict(GENERATE, max_new_tokens=40, min_new_tokens=40, output_logits=True, return_dict_in_generate=True)
    x = _ids(100)  # the tiny config's L is 128
    with torch.no_grad():
        cached = model.generate(input_ids=x, **kw)
        uncached = model.generate(input_ids=x, use_cache=False, **kw)
    assert torch.equal(cached.sequences, uncached.sequences)
    scale = float(_scores(uncached).abs().max())
    assert float((_scores(cached) - _scores(uncached)).abs().max()) / scale < 1e-4  # keys turned in float32
    inputs = _image_inputs("qwen2_5_vl")
    cache = DynamicCache()
    why = "^dynamic on qwen2_5_vl must re-rotate cached keys .* distinct M-RoPE positions per axis"
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match=why):
        model.generate(**inputs, **{CACHE: cache}, **GENERATE)
    assert cache.get_seq_length() == 0
    assert torch.isfinite(_logits(model, **inputs)).all()
