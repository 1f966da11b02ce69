"""Kept keys (``hf.attention.keys``): a decode step over a DynamicCache turns only the keys added since the last
step, and gives the numbers of the path that turns every cached key at every step (``keys.KEEP = False``), in
every cache change that could leave a kept copy stale."""

import pytest
import torch
from transformers import DynamicCache

import rope_extend
from rope_extend.hf import names
from rope_extend.hf.attention import keys, passes
from tests.test_attention import METHODS, ids, model_for

MOVING = ["self_extend", "rerope", "leaky_rerope"]  # methods whose far keys move (dual_chunk, string: none turn)


def steps(model, prompt, new, cache, edit=None):
    """Greedy decoding by hand: the prompt, then ``new`` one-token steps; ``edit(cache, step)`` between steps.
    Returns (tokens, logits of every step)."""
    out, logits = [], []
    with torch.no_grad():
        step = model(prompt, **rope_extend.cache_kwargs(cache), use_cache=True).logits[:, -1]
        for t in range(new):
            logits.append(step)
            token = step.argmax(-1, keepdim=True)
            out.append(token)
            if edit is not None:
                edit(cache, t)
            step = model(token, **rope_extend.cache_kwargs(cache), use_cache=True).logits[:, -1]
    return torch.cat(out, 1), torch.stack(logits)


def both(model, prompt, new, edit=None, make=lambda m: DynamicCache(config=m.config)):
    """``steps`` with kept keys and without."""
    got = steps(model, prompt, new, make(model), edit)
    keys.KEEP = False
    try:
        want = steps(model, prompt, new, make(model), edit)
    finally:
        keys.KEEP = True
    return got, want


def turned_slots(monkeypatch) -> list[int]:
    """How many key slots each ``passes._rotate`` call turns."""
    sizes: list[int] = []
    real = passes._rotate
    monkeypatch.setattr(
        passes, "_rotate", lambda layout, k, *a, **kw: sizes.append(k.shape[2]) or real(layout, k, *a, **kw)
    )
    return sizes


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("method", MOVING)
def test_decode_with_kept_keys_equals_turning_every_key(family, method, monkeypatch):
    """Tokens equal and logits bit-identical over 30 steps past 2.5 L; once the copy is made, a step turns one
    slot per layer (gemma3: the global layers; its sliding layers keep the per-step turn)."""
    model = model_for(family)
    rope_extend.patch(model, method, **METHODS[method])
    prompt = ids(n=24, batch=2, seed=3)
    sizes = turned_slots(monkeypatch)
    (tokens, logits), (want_tokens, want_logits) = both(model, prompt, 30)
    assert torch.equal(tokens, want_tokens)
    assert torch.equal(logits, want_logits), (logits - want_logits).abs().max()
    layers = model.config.num_hidden_layers
    if family == "llama":  # the prompt (24 rows: a few, the decode path) makes the copy, then one slot per step
        assert sizes[: 31 * layers] == [24] * layers + [1] * (30 * layers)
        assert sizes[31 * layers :] == [24] * layers + [n for n in range(25, 55) for _ in range(layers)]
    assert sizes.count(1) >= 30


@pytest.mark.parametrize("method", MOVING)
def test_cache_changed_between_steps_is_never_read_stale(method):
    """A crop, a batch reorder (beam search's), keys turned in place or replaced: the next step equals the path
    that turns every key (each edit changes the logits, so a stale copy would show)."""

    def edit(cache, t):
        layer = cache.layers[0]
        if t == 3:
            cache.crop(-2)
        elif t == 6:
            cache.reorder_cache(torch.tensor([1, 0]))
        elif t == 9:
            layer.keys.mul_(1.5)  # in place: same tensor, new version
        elif t == 12:
            layer.keys = layer.keys * 0.5

    model = model_for("llama")
    rope_extend.patch(model, method, **METHODS[method])
    prompt = ids(n=24, batch=2, seed=3)
    (tokens, logits), (want_tokens, want_logits) = both(model, prompt, 16, edit)
    assert torch.equal(tokens, want_tokens)
    assert torch.equal(logits, want_logits), (logits - want_logits).abs().max()
    plain = steps(model, prompt, 16, DynamicCache(config=model.config))[1]
    assert (plain[10] - logits[10]).abs().max() > 1e-3  # the edits changed the numbers


def test_generate_beam_and_continue_equal_and_unpatch_drops_the_hooks():
    model = model_for("llama")
    rope_extend.patch(model, "self_extend", **METHODS["self_extend"])
    prompt = ids(n=24, batch=1, seed=4)
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    runs = []
    for keep in (True, False):
        keys.KEEP = keep
        try:
            with torch.no_grad():
                beam = model.generate(prompt, num_beams=2, **kw)
                first = model.generate(prompt, return_dict_in_generate=True, **kw)
                more = torch.cat([first.sequences, prompt[:, :3]], 1)
                cache = getattr(first, "cache", None) or first.past_key_values
                again = model.generate(more, **rope_extend.cache_kwargs(cache), **kw)
        finally:
            keys.KEEP = True
        runs.append((beam, again))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    hooked = [m for m in model.modules() if names.KEPT_HOOK in m.__dict__]
    assert len(hooked) == model.config.num_hidden_layers
    rope_extend.unpatch(model)
    assert not [m for m in model.modules() if names.KEPT_HOOK in m.__dict__]
    assert not any(m._forward_pre_hooks for m in hooked)


def test_kept_only_beside_a_plain_dynamic_cache():
    """Kept keys are made only for the key tensor of a plain DynamicCache's full layer: not for an offloaded one
    (its layers leave the device between steps, a copy would stay behind) or another tensor (a compressed
    cache's keys rebuilt for the attention). SinkCache is refused with the attention methods."""
    from rope_extend.hf.attention import PLAN_ATTR

    model = model_for("llama")
    rope_extend.patch(model, "rerope", **METHODS["rerope"])
    module = model.model.layers[0].self_attn
    plan = module.__dict__[PLAN_ATTR]
    key = torch.zeros(1, 2, 4, 16)
    for cache, kept in [
        (DynamicCache(config=model.config), True),
        (DynamicCache(config=model.config, offloading=True), False),
    ]:
        cache.layers[0].keys = key
        plan.recorder.cache = cache
        assert (keys.holder(plan, module, key) is cache.layers[0]) == kept, cache
        assert keys.holder(plan, module, key.clone()) is None
    keys.KEEP = False
    try:
        assert keys.holder(plan, module, key) is None
    finally:
        keys.KEEP = True
        plan.recorder.cache = None
