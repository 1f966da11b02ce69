"""A dynamic method decoding with a KV cache, on every RoPE family of transformers' registry: exact or refused.

A dynamic method's frequencies follow the sequence length, so the keys a cache already holds must be turned to the
new frequencies at each forward (``hf.cache.CacheKeeper``). Its documented semantics (docs/serving.md) are those
of ``tests.matrix.reference.References.frozen``: a token's hidden states are those of the forward that fed it,
and every cached key carries the frequencies in use. For each family ``build`` makes, ``dynamic`` (x4, ``L`` = 16)
is fed a prompt below ``L`` and then chunks of 1 to 9 tokens past it through the model's own cache; after each
forward the last logits must equal the frozen reference's within ``TOLERANCE``, or the forward must be refused
with an ``UnsupportedModelError`` naming the method and the family (and the family is listed in ``REFUSED``).
A family listed in ``REFUSED`` that decodes exactly fails too: the list is the measured one.

The cell that was missing, and what it found: DeepSeek-V4's compressor caches hold keys that nothing turned (its
layers' types name no frequency set, so no key was turned at all), and Mistral 4's MLA cache stores its unrotated
latent as "keys", of the same size as the attention's keys in the tiny config, so the keeper turned the latent:
cached decode was 0.03 and 0.045 off the reference, silently. Both are refused now (a model's own cache layers;
``hf.layout``'s probe compares what the cache holds with what the attention saw).
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import rope_extend
from rope_extend import UnsupportedModelError
from tests.families.tiny import Unbuildable, build, rope_families, text_inputs
from tests.matrix.reference import _frozen_forward

L, FACTOR = 16, 4.0
PROMPT, CHUNKS = 8, (9, 1, 6, 8)  # 8 tokens, then forwards of 9 (past L = 16: the first turn), 1, 6 and 8 tokens
TOLERANCE = 1e-5  # float32; measured at most 1e-6 on the families that keep their keys (2e-7 unpatched)
# families whose cached keys the keeper cannot turn (MLA and other compressed caches, hybrid linear-attention
# caches, a model's own cache layers): refused at the first forward with a cache, in these words
REFUSED = frozenset(
    {
        "axk1",
        "axk2",
        "bailing_hybrid",
        "bamba",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "deepseek_v4",
        "dots3_note",
        "dots3_note_text",
        "falcon",
        "glm4_moe_lite",
        "glm_moe_dsa",
        "gpt_neox_japanese",
        "granitemoehybrid",
        "hy_v4",
        "hy_v4_vl",
        "kimi_k25",
        "lara_mini",
        "lfm2",
        "lfm2_moe",
        "lfm2_vl",
        "longcat_flash",
        "minicpm3",
        "minicpm_ocr",
        "minicpmv4_6",
        "minicpmv4_7",
        "mistral4",
        "mistral_large4",
        "olmo_hybrid",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen3_5_text",
        "qwen3_next",
        "qwen4_exp",
        "qwen4_exp_text",
        "sarvam_mla",
        "unlimited_ocr",
        "youtu",
    }
)
REFUSAL = "must re-rotate cached keys when its frequencies change"


def _ids() -> torch.Tensor:
    return torch.randint(3, 200, (1, PROMPT + sum(CHUNKS)), generator=torch.Generator().manual_seed(0))


def _cache(out):
    for name in ("past_key_values", "cache", "cache_params"):  # the output's name for it varies by family
        held = getattr(out, name, None)
        if held is not None:
            return held
    raise AttributeError(f"{type(out).__name__} returns no cache")


def _cache_argument(model) -> str:
    """transformers 5.24 names the cache ``cache`` (``past_key_values`` is deprecated there), 5.17 the latter."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _worst_gap(model, family: str) -> float:
    """The largest difference between cached decode's last logits and the frozen reference's, over the chunks."""
    ids, worst = _ids(), 0.0
    with torch.no_grad():
        out = model(**text_inputs(family, ids[:, :PROMPT]), use_cache=True)
        held, want = _frozen_forward(model, ids[:, :PROMPT], None)
        worst = (out.logits[0, -1].float() - want).abs().max().item()
        end = PROMPT
        for size in CHUNKS:
            feed = text_inputs(family, ids[:, end : end + size])
            out = model(**feed, **{_cache_argument(model): _cache(out)}, use_cache=True)
            end += size
            held, want = _frozen_forward(model, ids[:, :end], held)
            worst = max(worst, (out.logits[0, -1].float() - want).abs().max().item())
    return worst


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("family", rope_families())
def test_dynamic_cached_decode_is_exact_or_refused(family):
    try:
        model = build(family)
        own = _worst_gap(model, family)
    except Unbuildable as exc:
        pytest.skip(f"{family} is not buildable here: {exc}")
    except Exception as exc:  # noqa: BLE001 - the families snapshot pins which families build and run
        pytest.skip(f"{family} does not decode with a cache here, unpatched: {type(exc).__name__}")
    if own > TOLERANCE:
        pytest.skip(f"{family}'s own cached decode is {own:.1e} off its uncached forward, unpatched")
    try:
        rope_extend.patch(model, "dynamic", factor=FACTOR, original_max_position_embeddings=L)
    except (UnsupportedModelError, rope_extend.RopeExtendError) as exc:
        pytest.skip(f"dynamic is refused on {family} at patch time (the families snapshot pins it): {exc}")
    try:
        if family in REFUSED:
            with pytest.raises(UnsupportedModelError) as refused:
                _worst_gap(model, family)
            message = str(refused.value)
            assert f"dynamic on {family} {REFUSAL}" in message, message
            return
        try:
            gap = _worst_gap(model, family)
        except UnsupportedModelError as exc:
            pytest.fail(f"{family} is refused but not listed in REFUSED: {exc}")
        assert gap <= TOLERANCE, f"{family}: dynamic cached decode is {gap:.2e} off the frozen reference"
    finally:
        rope_extend.unpatch(model)
