"""`rope_extend.patch` on tiny random models of every supported family."""

import copy

import pytest
import torch
import transformers as T

import rope_extend
from rope_extend import NotPatchedError, RopeExtendError, UnsupportedModelError, cache_kwargs
from rope_extend.hf import cache_name
from tests.tiny import FAMILIES, tiny_config, tiny_model

L = 256  # the tiny models' max_position_embeddings


def longrope_factors(d):
    return {"short_factor": [1.0 + i / d for i in range(d // 2)], "long_factor": [2.0 + i for i in range(d // 2)]}


def method_params(method, model):
    if method == "string":  # reaches L + shifted_offset - local_window: past the 1.5 L the tests below ask for
        return {"shifted_offset": 3 * L // 4, "local_window": 8}
    if method != "longrope":
        return {}
    emb = model.get_decoder().rotary_emb if hasattr(model, "get_decoder") else None
    buffers = [b for n, b in emb.named_buffers() if n.endswith("inv_freq") and "original" not in n]
    return longrope_factors(2 * buffers[-1].numel())


def inputs(n=L + 100, seed=1):
    torch.manual_seed(seed)
    return torch.randint(3, 512, (2, n))


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def built_from_configured_config(family, model, method, **kwargs):
    config = rope_extend.configure(tiny_config(family), method, **kwargs)
    fresh = FAMILIES[family][1](config).eval()
    fresh.load_state_dict(model.state_dict())
    return fresh


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("method", ["yarn", "dynamic_yarn"])
def test_patched_equals_built_from_configured_config(family, method):
    model = tiny_model(family)
    ids = inputs()
    rope_extend.patch(model, method, factor=4)
    fresh = built_from_configured_config(family, model, method, factor=4)
    assert model.config.max_position_embeddings == fresh.config.max_position_embeddings == 4 * L
    assert model.config.rope_parameters == fresh.config.rope_parameters
    torch.testing.assert_close(logits(model, ids), logits(fresh, ids), rtol=0, atol=0)


@pytest.mark.parametrize("method", rope_extend.method_names())
def test_every_method_on_llama_equals_the_configured_model(method):
    model = tiny_model("llama")
    params = method_params(method, model)
    factor = 1.5 if method == "string" else 3  # STRING reaches less than 2 L
    rope_extend.patch(model, method, factor=factor, **params)
    fresh = built_from_configured_config("llama", model, method, factor=factor, **params)
    ids = inputs(int(factor * L))
    torch.testing.assert_close(logits(model, ids), logits(fresh, ids), rtol=0, atol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_unpatch_restores_bit_identical_logits(family):
    model = tiny_model(family)
    pristine = copy.deepcopy(model)
    ids = inputs()
    before = logits(model, ids)
    config_before = model.config.to_dict()
    for method in ("yarn", "dynamic", "linear"):
        rope_extend.patch(model, method, factor=2)
        assert not torch.equal(logits(model, ids), before)
    rope_extend.unpatch(model)
    assert torch.equal(logits(model, ids), before)
    assert model.config.to_dict() == config_before
    emb, ref = model.get_decoder().rotary_emb, pristine.get_decoder().rotary_emb
    assert emb.__dict__.keys() == ref.__dict__.keys()
    for name, buffer in ref.named_buffers():
        assert torch.equal(dict(emb.named_buffers())[name], buffer)
    with pytest.raises(NotPatchedError):
        rope_extend.unpatch(model)


def test_gemma3_scales_global_layers_only():
    model = tiny_model("gemma3")
    emb = model.model.rotary_emb
    local_before = emb.sliding_attention_inv_freq.clone()
    rope_extend.patch(model, "yarn", factor=4)
    assert torch.equal(emb.sliding_attention_inv_freq, local_before)
    assert emb.sliding_attention_attention_scaling == 1.0
    expected, scale = rope_extend.inv_freq("yarn", 16, 1_000_000.0, 4, L)
    assert torch.equal(emb.full_attention_inv_freq, expected) and emb.full_attention_attention_scaling == scale
    params = model.config.rope_parameters
    assert params["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert params["full_attention"]["rope_type"] == "yarn"


@pytest.mark.parametrize("family,dim", [("phi", 8), ("gpt_neox", 8)])
def test_partial_rotary_families(family, dim):
    model = tiny_model(family)
    rope_extend.patch(model, "ntk_by_parts", factor=4)
    emb = model.get_decoder().rotary_emb
    expected, _ = rope_extend.inv_freq("ntk_by_parts", 16, 10000.0, 4, L, partial_rotary_factor=0.5)
    assert emb.inv_freq.shape == (dim // 2,)  # head_dim 16 * partial_rotary_factor 0.5 = rotary dim 8
    assert torch.equal(emb.inv_freq, expected)


def test_patching_twice_equals_patching_once_and_never_compounds():
    once, twice, other_first = tiny_model(), tiny_model(), tiny_model()
    ids = inputs(600)
    rope_extend.patch(once, "yarn", factor=4)
    rope_extend.patch(twice, "yarn", factor=4)
    rope_extend.patch(twice, "yarn", factor=4)
    rope_extend.patch(other_first, "linear", factor=8)
    rope_extend.patch(other_first, "yarn", factor=4)
    for model in (twice, other_first):
        assert model.config.to_dict() == once.config.to_dict()
        assert torch.equal(logits(model, ids), logits(once, ids))
    assert once.config.max_position_embeddings == 1024 and once.config.original_max_position_embeddings == L


def test_target_length_is_the_alternative_to_factor():
    a, b = tiny_model(), tiny_model()
    rope_extend.patch(a, "yarn", target_length=1000)
    rope_extend.patch(b, "yarn", factor=1000 / L)
    assert a.config.max_position_embeddings == 1000
    assert a.config.rope_parameters == b.config.rope_parameters
    assert rope_extend.patched(a).factor == pytest.approx(1000 / L)


def test_inv_freq_stays_float32_after_casting():
    model = tiny_model()
    rope_extend.patch(model, "yarn", factor=4)
    expected = model.model.rotary_emb.inv_freq.clone()
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to(dtype=torch.bfloat16)):
        cast(model)
        emb = model.model.rotary_emb
        assert emb.inv_freq.dtype == torch.float32 and torch.equal(emb.inv_freq, expected)
    # and the cos table at a far position is the float32 one, not one computed from rounded frequencies
    pos = torch.tensor([[32767]])
    cos, _ = model.model.rotary_emb(torch.zeros(1, 1, 16, dtype=torch.float32), pos)
    want = torch.cos(32767 * expected.double()) * model.model.rotary_emb.attention_scaling
    torch.testing.assert_close(cos[0, 0, :8].double(), want, atol=1e-4, rtol=0)
    # an unpatched bf16 model shows the trap rope-extend avoids
    plain = tiny_model().to(torch.bfloat16)
    assert plain.model.rotary_emb.inv_freq.dtype == torch.bfloat16


@pytest.mark.parametrize("method", ["linear", "ntk", "ntk_by_parts", "yarn", "llama3"])
def test_cached_greedy_generation_equals_uncached_for_static_methods(method):
    model = tiny_model()
    rope_extend.patch(model, method, factor=4)
    prompt = inputs(300)[:1]
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, min_new_tokens=12)
    with torch.no_grad():
        cached = model.generate(prompt, use_cache=True, **kwargs)
        uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)


def test_dynamic_frequencies_follow_the_longest_position_of_the_sequence():
    from rope_extend.hf.rotary import bucket

    assert [bucket(n, 256) for n in (1, 256, 257, 272, 273, 600)] == [1, 256, 272, 272, 289, 607]
    model = tiny_model()
    rope_extend.patch(model, "dynamic", factor=4)
    emb = model.model.rotary_emb

    def expected(seq_len):  # frequencies follow the length on rope-extend's grid beyond L (hf.rotary.bucket)
        return rope_extend.inv_freq("dynamic", 16, 10000.0, 4, L, seq_len=bucket(seq_len, L))[0]

    assert torch.equal(emb.inv_freq, expected(L))  # before any forward: plain RoPE at L
    with torch.no_grad():
        out = model(inputs(600)[:1], use_cache=True)
        assert torch.equal(emb.inv_freq, expected(600))
        model(torch.tensor([[5]]), **cache_kwargs(cache_name.returned(out)), position_ids=torch.tensor([[600]]))
        assert torch.equal(emb.inv_freq, expected(601))
        model(torch.tensor([[5]]), position_ids=torch.tensor([[300]]))  # not a new sequence: keeps the longest
        assert torch.equal(emb.inv_freq, expected(601))
        model(inputs(100)[:1])  # a new sequence from position 0
        assert torch.equal(emb.inv_freq, expected(100))


def test_longrope_switches_to_long_factors_beyond_the_original_length():
    model = tiny_model()
    params = longrope_factors(16)
    rope_extend.patch(model, "longrope", factor=4, **params)
    emb = model.model.rotary_emb
    with torch.no_grad():
        model(inputs(L)[:1])
        assert torch.equal(emb.inv_freq, rope_extend.inv_freq("longrope", 16, 10000.0, 4, L, seq_len=L, **params)[0])
        model(inputs(L + 1)[:1])
        long, scale = rope_extend.inv_freq("longrope", 16, 10000.0, 4, L, seq_len=L + 1, **params)
        assert torch.equal(emb.inv_freq, long) and emb.attention_scaling == scale


# Llama 3.1's shipped scaling, at a tiny model's size (L = 64, shipped context 512)
LLAMA3_SHIPPED = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}


def test_shipped_scaling_is_replaced_and_the_factor_counts_from_the_shipped_context(caplog):
    shipped = dict(LLAMA3_SHIPPED)
    model = tiny_model(rope_parameters=dict(shipped), max_position_embeddings=512)
    ids = inputs(300)
    before = logits(model, ids)
    with caplog.at_level("WARNING", logger="rope_extend"):
        rope_extend.patch(model, "yarn", factor=2)
    assert "ships with rope scaling llama3" in caplog.text
    # 2 x the shipped 512 tokens, never 2 x L = 128 (shorter than what the model shipped with)
    assert model.config.max_position_embeddings == 1024 and model.config.rope_parameters["factor"] == 16.0
    assert model.config.rope_parameters["original_max_position_embeddings"] == 64
    expected = rope_extend.inv_freq("yarn", 16, 10000.0, 16, 64)[0]
    assert torch.equal(model.model.rotary_emb.inv_freq, expected)
    rope_extend.unpatch(model)
    assert model.config.rope_parameters == shipped and torch.equal(logits(model, ids), before)


def test_qwen_style_yarn_config_reads_its_original_length():
    shipped = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0}
    model = tiny_model("qwen2", rope_parameters=dict(shipped), max_position_embeddings=128)
    ids = inputs(300)
    before = logits(model, ids)
    rope_extend.patch(model, "yarn", target_length=512)  # the shipped scaling itself, max_position_embeddings 4 L
    assert model.config.max_position_embeddings == 512
    torch.testing.assert_close(logits(model, ids), before, rtol=0, atol=0)
    rope_extend.patch(model, "yarn", factor=4)  # counts from the shipped 4 x 128
    assert model.config.max_position_embeddings == 2048 and model.config.rope_parameters["factor"] == 16.0


def test_a_method_shorter_than_the_shipped_context_is_refused_unless_asked(tmp_path):
    shipped = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    model = tiny_model(rope_parameters=dict(shipped), max_position_embeddings=256)
    with pytest.raises(rope_extend.RopeExtendError, match=r"reaches 208 tokens, less than the 256 the model ships"):
        rope_extend.patch(model, "self_extend", group_size=4, window=16)
    assert rope_extend.patched(model) is None
    rope_extend.patch(model, "self_extend", group_size=4, window=16, target_length=200)  # asked for: allowed
    assert model.config.max_position_embeddings == 200


def test_configuring_again_counts_from_the_same_shipped_context_after_save_and_reload(tmp_path):
    import transformers

    shipped = dict(LLAMA3_SHIPPED)
    config = tiny_model(rope_parameters=dict(shipped), max_position_embeddings=512).config
    rope_extend.configure(config, "yarn", factor=2)
    config.save_pretrained(tmp_path)
    again = transformers.AutoConfig.from_pretrained(tmp_path)
    rope_extend.configure(again, "yarn", factor=2)  # replaces, from the shipped 512: never compounds
    assert again.max_position_embeddings == config.max_position_embeddings == 1024


@pytest.mark.parametrize(
    "kwargs,error,needle",
    [
        (dict(method="yaarn", factor=2), RopeExtendError, "did you mean 'yarn'"),
        (dict(method="yarn", factor=0.5), RopeExtendError, "factor must be >= 1"),
        (dict(method="yarn"), RopeExtendError, "exactly one of factor"),
        (dict(method="yarn", factor=2, target_length=512), RopeExtendError, "exactly one of factor"),
        (dict(method="yarn", factor=2, beta_fats=3), RopeExtendError, "did you mean 'beta_fast'"),
        (dict(method="yarn", factor=2, beta_fast=0.1), RopeExtendError, "beta_fast must be greater than beta_slow"),
        (dict(method="longrope", factor=2, short_factor=[1.0] * 4, long_factor=[1.0] * 4), RopeExtendError, "d/2 = 8"),
    ],
)
def test_errors_leave_the_model_untouched(kwargs, error, needle):
    model = tiny_model()
    rope_extend.patch(model, "linear", factor=2)
    config_before = model.config.to_dict()
    buffers_before = {n: b.clone() for n, b in model.named_buffers()}
    forward_before = model.model.rotary_emb.forward
    with pytest.raises(error, match=needle):
        rope_extend.patch(model, **kwargs)
    assert model.config.to_dict() == config_before
    assert all(torch.equal(b, buffers_before[n]) for n, b in model.named_buffers())
    assert model.model.rotary_emb.forward is forward_before
    assert rope_extend.patched(model).method.name == "linear"


def test_model_without_rotary_embeddings_is_refused():
    model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=64))
    with pytest.raises(UnsupportedModelError, match="no rotary embedding module"):
        rope_extend.patch(model, "yarn", factor=2)


def test_patch_through_peft():
    peft = pytest.importorskip("peft")
    model = tiny_model()
    ids = inputs()
    reference = copy.deepcopy(model)
    rope_extend.patch(reference, "yarn", factor=4)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    rope_extend.patch(wrapped, "yarn", factor=4)
    torch.testing.assert_close(logits(wrapped, ids), logits(reference, ids), rtol=0, atol=0)
    rope_extend.unpatch(wrapped)
    assert wrapped.config.rope_parameters["rope_type"] == "default"


@pytest.mark.parametrize("method", ["yarn", "dynamic"])
def test_patched_models_deepcopy_and_pickle(tmp_path, method):
    model = tiny_model()
    rope_extend.patch(model, method, factor=4)
    ids = inputs(600)
    expected = logits(model, ids)
    clone = copy.deepcopy(model)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    for other in (clone, loaded):
        assert torch.equal(logits(other, ids), expected)
        assert other.model.rotary_emb.forward.module is other.model.rotary_emb
        rope_extend.unpatch(other)
        assert other.config.rope_parameters["rope_type"] == "default"
    assert rope_extend.patched(model).method.name == method  # the original keeps its patch


@pytest.mark.parametrize("family", ["llama", "phi"])
def test_patch_on_the_meta_device_then_materialized(family):
    """Patched while on the meta device (accelerate's init_empty_weights), then to_empty + load_state_dict:
    the frequencies are recomputed when the buffers materialize (to_empty leaves garbage and the state dict
    does not hold these buffers); unpatch restores transformers' own frequencies."""
    _, model_cls, _ = FAMILIES[family]
    real = tiny_model(family)
    with torch.device("meta"):
        empty = model_cls(tiny_config(family))
    rope_extend.patch(empty, "yarn", factor=4)
    empty.to_empty(device="cpu")
    empty.load_state_dict(real.state_dict())
    empty.eval()
    ids = torch.randint(3, 500, (1, 600))
    plain = real(ids).logits
    rope_extend.patch(real, "yarn", factor=4)
    with torch.no_grad():
        torch.testing.assert_close(empty(ids).logits, real(ids).logits, rtol=0, atol=0)
        rope_extend.unpatch(empty)
        torch.testing.assert_close(empty(ids).logits, plain, rtol=0, atol=0)


def test_unpatch_is_atomic(monkeypatch):
    """A failure while undoing changes nothing: the patch stays in place and recorded, and unpatch can be
    retried."""
    from rope_extend.hf import config as hf_config

    model = tiny_model("llama")
    ids = torch.randint(3, 500, (1, 300))
    with torch.no_grad():
        plain = model(ids).logits
        rope_extend.patch(model, "yarn", factor=4)
        scaled = model(ids).logits
    real_restore = hf_config.restore
    calls = []

    def failing_restore(config, snap):
        calls.append(1)
        if len(calls) == 2:  # the first call builds the pristine copy; the second would write the config
            raise RuntimeError("disk on fire")
        return real_restore(config, snap)

    monkeypatch.setattr(hf_config, "restore", failing_restore)
    with pytest.raises(RuntimeError, match="disk on fire"):
        rope_extend.unpatch(model)
    monkeypatch.setattr(hf_config, "restore", real_restore)
    assert rope_extend.patched(model) is not None
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, scaled, rtol=0, atol=0)
        rope_extend.unpatch(model)
        torch.testing.assert_close(model(ids).logits, plain, rtol=0, atol=0)
