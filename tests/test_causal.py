"""Non-causal attention (``hf.causal``): the attention methods are refused, never silently made causal.

The methods' rules give relative positions to pairs whose key is at or before the query, and their attention
computes those pairs only. A layer that is bidirectional (PaliGemma's prefix: ``is_causal=False``), adds a bias of
its own to the scores (Doge's dynamic mask) or gets a mask that lets a query see a later key (a custom 4D mask) would
be changed beyond the method: before this check, ReRoPE with a window past every pair (no position moves) moved
PaliGemma's logits by 0.079 and Doge's (transformers 5.17) by 0.755.
"""

from types import SimpleNamespace

import pytest
import torch

import rope_extend
from rope_extend import UnsupportedModelError
from rope_extend.hf import causal
from tests.families.tiny import build
from tests.test_attention import METHODS
from tests.tiny import tiny_model

N = 24


def _causal(n, m):
    return (torch.arange(m)[None, :] <= torch.arange(n)[:, None] + (m - n))[None, None]


@pytest.mark.parametrize(("n", "m"), [(6, 6), (1, 9), (4, 9)])
def test_dense_accepts_causal_masks(n, m):
    allowed = _causal(n, m)
    assert causal.dense(allowed, n, m) is None
    padded = allowed.clone()
    padded[..., 0] = False  # left padding: fewer keys is still causal
    assert causal.dense(padded, n, m) is None
    additive = torch.zeros(1, 1, n, m).masked_fill(~allowed, torch.finfo(torch.float32).min)
    assert causal.dense(additive, n, m) is None
    assert causal.dense(torch.zeros(1, 1, n, m).masked_fill(~allowed, float("-inf")), n, m) is None


def test_dense_refuses_later_keys_and_biases():
    allowed = _causal(5, 5)
    prefix = allowed.clone()
    prefix[..., :3, :3] = True  # a bidirectional prefix of 3 tokens
    assert "after them" in causal.dense(prefix, 5, 5)
    assert "after them" in causal.dense(torch.ones(1, 1, 5, 5, dtype=torch.bool), 5, 5)
    biased = torch.zeros(1, 1, 5, 5).masked_fill(~allowed, torch.finfo(torch.float32).min)
    biased[0, 0, 4, 1] = 0.5
    assert "bias" in causal.dense(biased, 5, 5)


def test_flex_masks_are_evaluated_on_later_pairs():
    def block(mask_mod):
        return SimpleNamespace(mask_mod=mask_mod, kv_indices=torch.zeros(2, 1, 1, 1, dtype=torch.long))

    # mask_mod takes the query row and the key slot; a mask over a cache adds the offset itself (6 here)
    assert causal.flex(block(lambda b, h, q, k: k <= q), 7, 7) is None
    assert causal.flex(block(lambda b, h, q, k: (k <= q + 6) & (q + 6 - k < 3)), 3, 9) is None  # sliding, cached
    assert "after them" in causal.flex(block(lambda b, h, q, k: k <= q + 7), 3, 9)
    assert "after them" in causal.flex(block(lambda b, h, q, k: (k <= q) | (k < 2)), 7, 7)


def test_flags():
    assert causal.flag(SimpleNamespace(is_causal=False), None)
    assert causal.flag(SimpleNamespace(is_causal=True), False)
    assert causal.flag(SimpleNamespace(), None) is None


@pytest.mark.parametrize("family", ["paligemma", "doge"])
@pytest.mark.parametrize("method", ["self_extend", "dual_chunk", "rerope", "leaky_rerope", "string"])
def test_non_causal_families_are_refused_at_patch(family, method):
    model = build(family)
    x = torch.randint(3, 200, (1, N), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=x).logits
    reason = "is_causal=False" if family == "paligemma" else "bias of its own"
    with pytest.raises(UnsupportedModelError, match=rf"{family}: cannot apply '{method}': layer \d+ .*{reason}"):
        rope_extend.patch(model, method, **METHODS[method])
    assert rope_extend.patched(model) is None
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, before)


def test_logn_alone_on_a_bidirectional_model_is_accepted():
    """log-n moves no position: it scales each query, which a bidirectional layer allows as well."""
    model = build("paligemma")
    rope_extend.patch(model, "linear", factor=1, logn=True)
    assert rope_extend.patched(model) is not None


@pytest.mark.parametrize("implementation", ["eager", "sdpa", "flex_attention"])
@pytest.mark.parametrize("method", ["self_extend", "rerope"])
def test_a_mask_with_later_keys_is_refused_at_the_forward(implementation, method):
    model = tiny_model(attn_implementation=implementation)
    rope_extend.patch(model, method, **METHODS[method])
    x = torch.randint(3, 200, (1, N), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=x).logits
        # a 4D mask is passed to the layers as it is: the causal one gives the same logits
        same = model(input_ids=x, attention_mask=_causal(N, N)).logits
        torch.testing.assert_close(same, plain, rtol=0, atol=1e-5)
        prefix = _causal(N, N).clone()
        prefix[..., :8, :8] = True
        with pytest.raises(UnsupportedModelError, match=rf"{method} on .*after them.*causal attention"):
            model(input_ids=x, attention_mask=prefix)
