"""Attention methods and log-n over the caches transformers offers (rope_extend.hf.slots): static caches
(``cache_implementation="static"`` and a ``StaticCache`` passed in), their sliding-window layers, the deprecated
static names, offloaded and quantized caches, left padding, Gemma 3's local layers, eager / sdpa / flex / flash.

Each cell generates past ``L`` and is checked against the uncached explicit reference of tests/test_attention
(``reference_logits``: every pair at the method's relative position, plain softmax) on the sequence it produced:
the greedy token of every step is the reference's argmax, and the logits of every step are within ``TOL`` of the
reference's (measured: 6e-7 at most, Gemma 3); or the cell is refused with a message.
"""

import pytest
import torch
from transformers import DynamicCache, QuantizedCache, StaticCache
from transformers import cache_utils as cu

import rope_extend
from rope_extend import UnsupportedModelError, cache_kwargs
from rope_extend.hf import attention as A
from rope_extend.hf import slots
from tests.test_attention import METHODS, L, flash_stand_in, ids, model_for, reference_logits, relative

TOL = 2e-5
NEW = 20
# the caller's cache as ``past_key_values``, which 5.17 takes and 5.24 still takes (renamed ``cache``, with a warning)
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
# name -> (method patched, its parameters, logn); "logn" is log-n alone over plain RoPE
CASES = {
    **{m: (m, p, False) for m, p in METHODS.items()},
    "self_extend+logn": ("self_extend", METHODS["self_extend"], True),
    "logn": ("none", {}, True),
}


def patched(family, case, implementation=None, **over):
    """A tiny model of ``family`` loaded with ``implementation`` (the family's default if None), patched."""
    model = model_for(family, **over)
    if implementation is not None:
        model.config._attn_implementation = implementation
    method, params, logn = CASES[case]
    if method == "none":
        rope_extend.patch(model, "linear", factor=1, logn=True)
    else:
        rope_extend.patch(model, method, logn=logn, **params)
    return model


def generate(model, prompt, **kw):
    with torch.no_grad():
        out = model.generate(
            prompt,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
            **kw,
        )
    return out.sequences, torch.stack(out.logits, 1)


def assert_exact(model, case, prompt, **kw):
    """Greedy tokens and per-step logits of ``generate(prompt, **kw)`` against the reference; returns the error."""
    sequences, logits = generate(model, prompt, **kw)
    method, params, logn = CASES[case]
    want = reference_logits(model, method, params, sequences, logn=logn)[:, prompt.shape[1] - 1 : -1]
    assert sequences.shape[1] == prompt.shape[1] + NEW > L
    assert torch.equal(sequences[:, prompt.shape[1] :], want.argmax(-1)), case
    error = (logits - want).abs().max().item()
    assert error < TOL, (case, error)
    return error


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("case", list(CASES))
def test_static_cache_equals_the_explicit_reference(case, implementation):
    """sdpa through ``cache_implementation="static"``; eager through a ``StaticCache`` passed in, larger than the
    generation (slots left empty at the end)."""
    model = patched("llama", case, implementation)
    prompt = ids(n=24, batch=1, seed=3)
    if implementation == "sdpa":
        assert_exact(model, case, prompt, cache_implementation="static")
    else:
        assert_exact(model, case, prompt, **cache_kwargs(StaticCache(config=model.config, max_cache_len=64)))


def test_the_static_cache_comparison_can_fail(monkeypatch):
    """Without the filled length (keys taken to end at the last query, as before hf.slots), the same check fails."""
    model = patched("llama", "self_extend")
    monkeypatch.setattr(slots, "filled", lambda *args: None)
    with pytest.raises(AssertionError):
        assert_exact(model, "self_extend", ids(n=24, batch=1, seed=3), cache_implementation="static")


def test_stale_slots_past_the_filled_length_are_never_read():
    """A static cache's slots after its length hold whatever was there (zeros, or keys of a cropped or earlier
    sequence): filled with large values after the prefill, decoding is still the reference's."""
    model = patched("llama", "dual_chunk")
    x = ids(n=40, batch=1, seed=5)
    want = reference_logits(model, *CASES["dual_chunk"][:2], x)[0]
    cache = StaticCache(config=model.config, max_cache_len=64)
    with torch.no_grad():
        model(x[:, :30], **cache_kwargs(cache))
        for layer in cache.layers:
            layer.keys[:, :, 30:] = 1e3
            layer.values[:, :, 30:] = -1e3
        got = [model(x[:, t : t + 1], **cache_kwargs(cache)).logits[0, -1] for t in range(30, 40)]
    assert (torch.stack(got) - want[30:]).abs().max().item() < TOL


@pytest.mark.parametrize("case", ["self_extend", "dual_chunk", "string", "logn"])
def test_left_padded_batch_with_a_static_cache_equals_its_rows_alone(case):
    """generate pads on the left and fills the padded position ids with 1; each row equals the row generated
    alone (which the test above checks against the reference)."""
    model = patched("llama", case)
    x, pad = ids(n=24, batch=2, seed=4), 5
    padded, mask = x.clone(), torch.ones_like(x)
    padded[1, :pad], mask[1, :pad] = 0, 0
    sequences, logits = generate(model, padded, attention_mask=mask, cache_implementation="static")
    for row, prompt in ((0, x[:1]), (1, x[1:, pad:])):
        alone, alone_logits = generate(model, prompt)
        assert torch.equal(sequences[row, x.shape[1] :], alone[0, prompt.shape[1] :]), (case, row)
        assert (logits[row] - alone_logits[0]).abs().max().item() < TOL, (case, row)


@pytest.mark.parametrize("case", list(CASES))
def test_gemma3_static_cache_keeps_its_sliding_window_layers(case):
    """Gemma 3 style: a static cache gives the local layers ``StaticSlidingWindowLayer`` (16 slots, the model's own
    attention, filled up to their length, then rolled) and the global layers ``StaticLayer`` (the method's). An
    14-token prompt fills less than the window; decoding crosses it and L."""
    model = patched("gemma3", case)
    cache = StaticCache(config=model.config, max_cache_len=48)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [cu.StaticSlidingWindowLayer, cu.StaticLayer] * 2
    assert_exact(model, case, ids(n=14, batch=1, seed=3), **cache_kwargs(cache))


@pytest.mark.parametrize("implementation", ["static", "sliding_window", "dynamic"])
def test_method_layers_on_sliding_window_static_layers(implementation):
    """Mistral with a 20-token window in every layer: the method's layers read a ``StaticSlidingWindowLayer``
    (not yet full for the 14-token prompt: the window tensor filled from slot 0; then full and rolled)."""
    for case in ("self_extend", "rerope"):
        model = patched("mistral", case, sliding_window=20)
        assert_exact(model, case, ids(n=14, batch=1, seed=3), cache_implementation=implementation)


@pytest.mark.parametrize("implementation", ["hybrid", "hybrid_chunked"])
def test_deprecated_static_cache_names(implementation):
    """``sliding_window`` and ``hybrid_chunked`` build a ``StaticCache`` (5.24); ``hybrid`` is dropped by generate
    for a dynamic cache. Each exact, on the plain and the Gemma 3 shape."""
    for family, n in (("llama", 24), ("gemma3", 14)):
        model = patched(family, "self_extend")
        assert_exact(model, "self_extend", ids(n=n, batch=1, seed=3), cache_implementation=implementation)


class _NoStream:
    """A stream that does nothing: transformers' offloading waits on CUDA streams, which a CPU torch lacks."""

    def wait_stream(self, *_):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False


@pytest.mark.parametrize("kind", ["offloaded", "offloaded_static"])
def test_offloaded_caches(kind, monkeypatch):
    """``offloaded`` is a ``DynamicCache(offloading=True)``, ``offloaded_static`` a ``StaticCache(offloading=True)``:
    the same layers, moved off the device between layers. On the CPU the streams are stood in for (with CUDA,
    ``generate(cache_implementation=kind)`` runs them as they are)."""
    model = patched("llama", "self_extend")
    if torch.cuda.is_available():
        model = model.cuda()
        assert_exact(model, "self_extend", ids(n=24, batch=1, seed=3).cuda(), cache_implementation=kind)
        return
    monkeypatch.setattr(torch.cuda, "default_stream", lambda *_: _NoStream())
    if kind == "offloaded":
        cache = DynamicCache(config=model.config, offloading=True)
    else:
        cache = StaticCache(config=model.config, max_cache_len=48, offloading=True)
    cache.prefetch_stream = _NoStream()
    assert_exact(model, "self_extend", ids(n=24, batch=1, seed=3), **cache_kwargs(cache))


def _explicit_attention(method, params, inv_freq, query, key, value, qpos, kpos, scaling):
    """The reference's attention (every pair at the method's relative position) for queries at ``qpos`` over keys
    at ``kpos``: what ``Reference`` computes for a whole sequence, here for a decode step's rows."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1).double(), value.repeat_interleave(groups, 1).double()
    i, j = qpos[:, None], kpos[None, :]
    rel = torch.tensor([[relative(method, params, a, b) for b in kpos.tolist()] for a in qpos.tolist()])
    angles = (i - rel - j).double()[..., None] * inv_freq.double()  # move key j to i - rel
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    k = key[:, :, None]
    half = k.shape[-1] // 2
    k = k * cos + torch.cat([-k[..., half:], k[..., :half]], -1) * sin
    scores = torch.einsum("bhid,bhijd->bhij", query.double(), k) * scaling
    weights = torch.softmax(scores.masked_fill(j > i, float("-inf")), -1)
    return torch.matmul(weights, value).transpose(1, 2)


def test_fp8_quantized_cache_positions(monkeypatch):
    """``QuantizedCache("fp8")`` (the backend that runs without extra packages; quanto and HQQ need theirs)
    returns dequantized keys ending at the newest token. Its rounding changes the logits as much as it changes the
    unpatched model's (about 1e-2 here), so the check is per call: every method layer's output, at every step,
    equals the explicit attention over the very keys and values the cache gave it, at their positions."""
    if not hasattr(cu, "Fp8QuantizedLayer"):
        pytest.skip("this transformers has no fp8 cache backend (5.17: quanto and HQQ only, each its own package)")
    calls = []
    real = A._attend

    def spy(module, plan, query, key, value, mask, scaling, softcap, position_ids, sinks=None):
        out = real(module, plan, query, key, value, mask, scaling, softcap, position_ids, sinks)
        calls.append((query, key, value, position_ids[0], scaling, out))
        return out

    monkeypatch.setattr(A, "_attend", spy)
    for case in METHODS:
        model = patched("llama", case)
        calls.clear()
        sequences, _ = generate(model, ids(n=24, batch=1, seed=3), **cache_kwargs(QuantizedCache("fp8", model.config)))
        assert len(calls) == 2 * NEW and sequences.shape[1] > L  # two layers, a prefill and 19 decode steps
        inv_freq = model.model.rotary_emb.inv_freq
        for query, key, value, qpos, scaling, out in calls[2:]:  # the decode steps: quantized keys
            kpos = torch.arange(qpos[-1] - key.shape[2] + 1, qpos[-1] + 1)
            want = _explicit_attention(case, METHODS[case], inv_freq, query, key, value, qpos, kpos, scaling)
            assert (out.double() - want).abs().max().item() < 1e-5, case


class _OddLayer(cu.CacheLayerMixin):
    """A cache layer of a class hf.slots does not know (keys kept as a dynamic layer keeps them)."""

    is_compileable = False

    def lazy_initialization(self, key_states, value_states):
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], -2)
        self.values = torch.cat([self.values, value_states], -2)
        return self.keys, self.values

    def get_seq_length(self):
        return self.keys.shape[-2] if self.is_initialized else 0

    def get_mask_sizes(self, query_length):
        return self.get_seq_length() + query_length, 0

    def get_max_length(self):
        return -1


def test_unknown_cache_layers_are_refused_before_anything_runs():
    model = patched("llama", "self_extend")
    cache = cu.Cache(layers=[_OddLayer(), _OddLayer()])
    with pytest.raises(UnsupportedModelError, match=r"_OddLayer \(layer 0\) keep their keys in slots rope-extend"):
        generate(model, ids(n=24, batch=1, seed=3), **cache_kwargs(cache))
    assert cache.get_seq_length() == 24  # the first layer's update ran, its attention refused: no output


def test_a_static_layer_seen_through_a_slice_is_refused():
    """A model that hands attention part of a static layer's slots: which slot is the newest key is unknown."""
    layer = cu.StaticLayer(max_cache_len=64)
    layer.lazy_initialization(torch.zeros(1, 2, 0, 16), torch.zeros(1, 2, 0, 16))
    watch = slots.Watch()
    watch.cache = cu.Cache(layers=[layer])
    module = torch.nn.Module()
    module.layer_idx = 0
    with pytest.raises(UnsupportedModelError, match="attends over 10 keys from a StaticLayer of 64 slots"):
        slots.filled(watch, module, torch.zeros(1, 2, 10, 16))
    assert slots.filled(watch, module, torch.zeros(1, 2, 64, 16)) is layer.cumulative_length


def test_flex_attention_with_a_static_cache():
    """The method's layers are exact over FlexAttention's ``BlockMask`` with a static cache; log-n alone keeps
    transformers' FlexAttention, whose mask reads the static layer's length after the layer's own update (every
    query sees the empty slot after it: 1e-2 off unpatched, transformers 5.17 and 5.24), and is refused at the
    prefill's first layer."""
    model = patched("llama", "self_extend", "flex_attention")
    assert_exact(model, "self_extend", ids(n=24, batch=1, seed=3), cache_implementation="static")
    model = patched("llama", "logn", "flex_attention")
    with pytest.raises(UnsupportedModelError, match=r"linear \(log-n\) with flex_attention and a static cache"):
        generate(model, ids(n=24, batch=1, seed=3), cache_implementation="static")


def test_flash_attention_padding_mask_with_a_static_cache(monkeypatch):
    """FlashAttention's padding mask (stood in for: no CUDA here) with a static cache covers every slot, the empty
    ones masked; the method's layers cut it at the newest key. A left-padded batch: each row as the sdpa model's
    row alone."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", flash_stand_in)
    sdpa = patched("llama", "self_extend")
    model = patched("llama", "self_extend", "flash_attention_2")
    x, pad = ids(n=24, batch=2, seed=4), 5
    padded, mask = x.clone(), torch.ones_like(x)
    padded[1, :pad], mask[1, :pad] = 0, 0
    sequences, logits = generate(model, padded, attention_mask=mask, cache_implementation="static")
    for row, prompt in ((0, x[:1]), (1, x[1:, pad:])):
        alone, alone_logits = generate(sdpa, prompt)
        assert torch.equal(sequences[row, x.shape[1] :], alone[0, prompt.shape[1] :]), row
        assert (logits[row] - alone_logits[0]).abs().max().item() < TOL, row
