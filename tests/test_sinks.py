"""Attention sinks (``rope_extend.sinks``, StreamingLLM): the cache stays within sinks + window, positions stay
inside it, and every step's logits equal a recompute of the kept tokens."""

import pytest
import torch

import rope_extend
from rope_extend import RopeExtendError, SinkCache, UnsupportedModelError
from tests.tiny import tiny_model

SINKS, WINDOW = 3, 13


def kept_tokens(seq, sinks=SINKS, window=WINDOW):
    return seq if len(seq) <= sinks + window else seq[:sinks] + seq[-window:]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3", "phi", "gpt_neox", "cohere"])
def test_every_step_equals_a_recompute_of_the_kept_tokens(family):
    """One layer, so a token's key and value depend on the token and its position only: after each step the
    logits equal an uncached forward of the kept tokens (sinks, then the window) at positions 0 .. n-1. Half
    pairing, interleaved (Cohere), partial rotary (Phi, GPT-NeoX), q/k norms (Qwen3), a sliding window and
    two frequency sets (Gemma 2, 3)."""
    model = tiny_model(family, max_position_embeddings=64, num_hidden_layers=1).eval()
    torch.manual_seed(0)
    seq = torch.randint(3, 500, (10,)).tolist()
    cache = SinkCache(model, sink_tokens=SINKS, window=WINDOW)
    worst = 0.0
    with torch.no_grad():
        out = model(torch.tensor([seq]), past_key_values=cache, use_cache=True)
        for step in range(40):
            token = int(out.logits[0, -1].argmax()) if step % 3 else int(torch.randint(3, 500, ()))
            seq.append(token)
            out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            kept = kept_tokens(seq)
            assert cache.get_seq_length() == len(kept) <= SINKS + WINDOW
            want = model(torch.tensor([kept])).logits[0, -1]
            worst = max(worst, (out.logits[0, -1] - want).abs().max().item())
    assert cache.evicted == len(seq) - SINKS - WINDOW == 34
    assert worst < 1e-4, worst


def _positions_seen(model):
    seen = []
    rotary = model.get_decoder().rotary_emb

    def record(module, args, kwargs):
        positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        seen.append(int(positions.max()))

    handle = rotary.register_forward_pre_hook(record, with_kwargs=True)
    return seen, handle


@pytest.mark.parametrize("family, method", [("llama", None), ("qwen2", "yarn"), ("gemma3", None)])
def test_generate_stays_within_the_cache_and_equals_the_full_cache_until_it_fills(family, method):
    model = tiny_model(family, max_position_embeddings=64).eval()
    if method:
        rope_extend.patch(model, method, factor=2)
    torch.manual_seed(0)
    ids = torch.randint(3, 500, (1, 10))
    with torch.no_grad():
        roomy = model.generate(ids, max_new_tokens=30, do_sample=False, past_key_values=SinkCache(model, 4, 100))
        full = model.generate(ids, max_new_tokens=30, do_sample=False)
        assert torch.equal(roomy, full)  # nothing evicted: the same as transformers' DynamicCache
        cache = SinkCache(model, sink_tokens=4, window=20)
        seen, handle = _positions_seen(model)
        try:
            out = model.generate(ids, max_new_tokens=200, do_sample=False, past_key_values=cache)
        finally:
            handle.remove()
    assert out.shape == (1, 210)
    assert max(seen) == 23  # positions never leave the cache
    assert all(layer.keys.shape[-2] == 24 for layer in cache.layers) and cache.evicted == 209 - 24
    shorter = SinkCache(model, sink_tokens=4, window=20)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=40, do_sample=False, past_key_values=shorter)
    assert shorter.nbytes() == cache.nbytes() > 0  # 50 tokens or 210: the same bytes


def test_the_prompt_window_padding_and_parameters_are_checked():
    model = tiny_model("llama", max_position_embeddings=64).eval()
    ids = torch.randint(3, 500, (2, 12))
    with pytest.raises(RopeExtendError, match="12 new tokens in one forward, more than the window of 8"):
        model.generate(ids, max_new_tokens=2, past_key_values=SinkCache(model, 2, 8))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.raises(RopeExtendError, match="attention mask has padding"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, past_key_values=SinkCache(model, 2, 30))
    with pytest.raises(RopeExtendError, match="window must be an integer >= 1"):
        SinkCache(model, 2, 0)
    with pytest.raises(RopeExtendError, match="sink_tokens must be an integer >= 0"):
        SinkCache(model, -1, 8)


@pytest.mark.parametrize("method", ["dynamic", "self_extend", "dual_chunk"])
def test_methods_that_assign_positions_themselves_are_refused(method):
    model = tiny_model("llama", max_position_embeddings=64).eval()
    rope_extend.patch(model, method, **({"factor": 2} if method == "dynamic" else {}))
    with pytest.raises(UnsupportedModelError, match="attention sinks assign positions inside the cache"):
        SinkCache(model, 4, 20)


def test_a_cache_made_before_a_dynamic_patch_is_refused_at_the_forward():
    model = tiny_model("llama", max_position_embeddings=64).eval()
    cache = SinkCache(model, 4, 20)
    rope_extend.patch(model, "dynamic_yarn", factor=2)
    with pytest.raises(UnsupportedModelError, match="dynamic_yarn is a dynamic method"):
        model.generate(torch.randint(3, 500, (1, 6)), max_new_tokens=2, past_key_values=cache)
