"""``keep_shipped=True``: an attention method over the rope scaling the model ships with, against the authors' rule.

STRING's authors (HKUNLP/STRING, ``string_for_llama.py``) run Llama 3.1 with its ``llama3`` frequencies, take
``L = config.max_position_embeddings`` (the shipped context ``C``) and ``S = 0.33 L``, and multiply cos and sin by
``1 + 0.1 ln 2``. The reference here runs on the *unpatched* model: queries and keys as transformers rotates them
with the shipped scaling (its attention scale included), each key turned further to the authors' relative position
with the frequencies transformers holds at that length, every logit times the method's factor squared.
"""

import math

import pytest
import torch

import rope_extend
from rope_extend import RopeExtendError, UnsupportedModelError
from rope_extend.methods._common import rope_frequencies
from tests.test_attention import METHODS, ids, model_for, reference_logits, run, small_blocks  # noqa: F401

L, C = 32, 128  # pretraining length, and the context the shipped scaling gives (max_position_embeddings)
SHIPPED = {
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    # GPT-OSS's form: yarn with its attention factor 0.1 ln s + 1 on cos and sin, no truncation of the ramp
    "yarn": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
}
STRING_FACTOR = 1 + 0.1 * math.log(2)
TOLERANCE = 2e-5  # float32 logits of order 1: the passes and the explicit reference differ by rounding only


def shipped_model(kind="llama3", family="llama"):
    rope = {**SHIPPED[kind], "original_max_position_embeddings": L, "rope_theta": 10000.0}
    return model_for(family, rope_parameters=rope, max_position_embeddings=C)


def longrope_model(family="phi3"):
    """Phi-3's form: longrope without a factor (transformers reads max_position_embeddings / L), short factors up
    to L, long beyond; the attention scale sqrt(1 + ln 4 / ln 32)."""
    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.5 * i for i in range(8)],
        "original_max_position_embeddings": L,
        "rope_theta": 10000.0,
    }
    if family == "phi3":  # Phi-3 also keeps L at the top of its config
        return model_for(family, rope_parameters=rope, max_position_embeddings=C, original_max_position_embeddings=L)
    return model_for(family, rope_parameters=rope, max_position_embeddings=C)


def test_string_over_llama3_is_the_authors_setting():
    """Defaults from C = 128 as the authors set them from 131072: S = int(0.33 C) = 42, W = min(128, S/2) = 21;
    the llama3 frequencies stay bit for bit; logits equal the explicit reference at 140 tokens (past C, inside the
    reach C + S - W = 149)."""
    model = shipped_model()
    x = ids(n=140)
    llama3 = model.model.rotary_emb.inv_freq.clone()
    authors = dict(shifted_offset=int(0.33 * C), local_window=min(128, int(0.33 * C) // 2))
    want = reference_logits(model, "string", authors, x, logit_scale=STRING_FACTOR**2)
    plain = run(model, x)
    rope_extend.patch(model, "string", keep_shipped=True)
    scaling = rope_extend.patched(model)
    assert scaling.original_max_position_embeddings == C and scaling.target_length == C + 42 - 21
    assert scaling.rules().window == 42 and scaling.rules().local_window == 21
    assert scaling.shipped.method.name == "llama3" and scaling.pretraining_length == L
    assert torch.equal(model.model.rotary_emb.inv_freq, llama3)
    assert model.model.rotary_emb.attention_scaling == pytest.approx(STRING_FACTOR)
    got = run(model, x)
    assert (got - want).abs().max().item() < TOLERANCE
    assert (got - plain).abs().max().item() > 1e-3  # the method changed something
    assert model.config.original_max_position_embeddings == L  # the pretraining length stays where it was


def test_the_default_still_replaces_the_shipped_scaling():
    model = shipped_model()
    with pytest.raises(RopeExtendError, match=r"string reaches 37 tokens, less than the 128 the model ships with"):
        rope_extend.patch(model, "string")  # from L = 32: 32 + 10 - 5
    rope_extend.patch(model, "string", target_length=37)
    assert rope_extend.patched(model).shipped is None
    assert torch.equal(model.model.rotary_emb.inv_freq, rope_frequencies(16, 10000.0))  # plain RoPE


@pytest.mark.parametrize("kind", ["llama3", "yarn"])
@pytest.mark.parametrize("method", list(METHODS))
def test_every_attention_method_keeps_the_shipped_frequencies_exactly(kind, method):
    """Over yarn, the rotary's YaRN factor 0.1 ln 4 + 1 stays on cos and sin and the method's own factor (STRING's)
    multiplies it."""
    model = shipped_model(kind)
    x = ids(n=140)
    scale = STRING_FACTOR**2 if method == "string" else 1.0
    want = reference_logits(model, method, METHODS[method], x, logit_scale=scale)
    before = model.model.rotary_emb.inv_freq.clone(), model.model.rotary_emb.attention_scaling
    rope_extend.patch(model, method, keep_shipped=True, **METHODS[method])
    assert torch.equal(model.model.rotary_emb.inv_freq, before[0])
    assert model.model.rotary_emb.attention_scaling == pytest.approx(before[1] * math.sqrt(scale))
    assert (run(model, x) - want).abs().max().item() < TOLERANCE, (kind, method)


def test_log_n_and_the_dual_chunk_temperature_count_from_the_shipped_context():
    """log-n divides by ln C; Dual Chunk's temperature is 1 + t ln(target / C)."""
    model = shipped_model("yarn")
    x = ids(n=140)
    want = reference_logits(model, "rerope", METHODS["rerope"], x, logn=True, length=C)
    rope_extend.patch(model, "rerope", keep_shipped=True, logn=True, **METHODS["rerope"])
    assert (run(model, x) - want).abs().max().item() < TOLERANCE
    rope_extend.unpatch(model)
    m = 1 + 0.1 * math.log(2)
    want = reference_logits(model, "dual_chunk", METHODS["dual_chunk"], x, logit_scale=m**2)
    rope_extend.patch(model, "dual_chunk", keep_shipped=True, factor=2, temperature=0.1, **METHODS["dual_chunk"])
    assert rope_extend.patched(model).target_length == 2 * C
    assert (run(model, x) - want).abs().max().item() < TOLERANCE


def test_phi3_longrope_is_kept_with_its_switch_at_the_pretraining_length():
    """Phi-3's longrope switches from short to long factors past L: the kept frequencies follow the length as
    transformers' do, exact against the reference on either side of L."""
    model = longrope_model()
    rotary = model.model.rotary_emb
    params = dict(shifted_offset=12, local_window=4)
    for n in (30, 80):
        x = ids(n=n)
        want = reference_logits(model, "string", params, x, logit_scale=STRING_FACTOR**2)
        unpatched = rotary.inv_freq.clone(), rotary.attention_scaling
        rope_extend.patch(model, "string", keep_shipped=True, **params)
        assert rope_extend.patched(model).shipped.method.name == "longrope"
        got = run(model, x)
        assert torch.equal(rotary.inv_freq, unpatched[0]), n  # short at 30, long at 80, as transformers had them
        assert rotary.attention_scaling == pytest.approx(unpatched[1] * STRING_FACTOR)
        assert (got - want).abs().max().item() < TOLERANCE, n
        rope_extend.unpatch(model)


@pytest.mark.parametrize("kind", ["llama3", "longrope"])
def test_greedy_generation_with_the_cache_equals_without(kind):
    """Past S and, for longrope, across its switch at L (the cached keys are turned to the long factors). On a
    Llama: Phi-3's own generate drops the cache at L, and on transformers 5.17 that re-run disagrees with the
    uncached run even unpatched."""
    model = longrope_model("llama") if kind == "longrope" else shipped_model()
    params = dict(shifted_offset=12, local_window=4)
    rope_extend.patch(model, "string", keep_shipped=True, **params)
    prompt = ids(n=24, batch=1, seed=3)
    kw = dict(max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(prompt, use_cache=True, **kw)
        uncached = model.generate(prompt, use_cache=False, **kw)
    assert cached.shape[1] == 54 > L
    assert torch.equal(cached, uncached)


def test_save_reload_and_patch_again(tmp_path):
    """The config records the kept scaling under rope_parameters.shipped; the reloaded model runs the same, a new
    patch counts from the same C, and unpatch gives back the shipped llama3 bit for bit."""
    model = shipped_model()
    x = ids(n=140)
    before = run(model, x)
    shipped_rope = dict(model.config.rope_parameters), model.config.max_position_embeddings
    rope_extend.patch(model, "string", keep_shipped=True)
    want = run(model, x)
    params = model.config.rope_parameters
    assert params["rope_type"] == "string" and params["original_max_position_embeddings"] == C
    assert params["shipped"] == {**SHIPPED["llama3"], "original_max_position_embeddings": L}
    model.save_pretrained(tmp_path)
    again = type(model).from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert (run(again, x) - want).abs().max().item() < 1e-6
    assert again.config.original_max_position_embeddings == L
    rope_extend.patch(again, "self_extend", keep_shipped=True, group_size=4)  # from the same C: W = C / 4
    assert rope_extend.patched(again).target_length == (C - C // 4) * 4 + C // 4
    rope_extend.patch(again, "yarn", factor=2)  # replaces: 2 x C, from L
    assert again.config.max_position_embeddings == 2 * C and again.config.rope_parameters["factor"] == 2 * C / L
    rope_extend.unpatch(model)
    assert (model.config.rope_parameters, model.config.max_position_embeddings) == shipped_rope
    assert torch.equal(run(model, x), before)


def test_configure_builds_the_patched_model():
    model = shipped_model("yarn")
    config = rope_extend.configure(type(model.config).from_dict(model.config.to_dict()), "string", keep_shipped=True)
    torch.manual_seed(0)
    built = type(model)(config).eval()
    built.load_state_dict(model.state_dict())
    rope_extend.patch(model, "string", keep_shipped=True)
    x = ids(n=140)
    assert (run(built, x) - run(model, x)).abs().max().item() < 1e-6


def test_plain_rope_has_nothing_to_keep():
    """keep_shipped on a model that ships plain RoPE is STRING as usual (the authors' code: plain RoPE when the
    config has no rope_scaling)."""
    model = model_for("llama")
    x = ids()
    rope_extend.patch(model, "string", **METHODS["string"])
    want, config = run(model, x), model.config.to_dict()
    rope_extend.patch(model, "string", keep_shipped=True, **METHODS["string"])
    assert torch.equal(run(model, x), want) and model.config.to_dict() == config
    assert rope_extend.patched(model).shipped is None


@pytest.mark.parametrize(
    "method, params, error, message",
    [
        ("yarn", dict(factor=2), RopeExtendError, "yarn is a frequency method, which replaces the shipped"),
        ("linear", dict(factor=1, logn=True), RopeExtendError, "leave keep_shipped out"),
        ("string", dict(keep_shipped="yes"), RopeExtendError, "keep_shipped must be true or false, got 'yes'"),
    ],
)
def test_bad_requests_raise_before_touching(method, params, error, message):
    model = shipped_model()
    before = model.config.to_dict()
    with pytest.raises(error, match=message):
        rope_extend.patch(model, method, **{"keep_shipped": True, **params})
    assert model.config.to_dict() == before and rope_extend.patched(model) is None


def test_a_shipped_record_beside_plain_rope_is_refused_by_name():
    """A hand-made rope dict with keep_shipped's record but a rope type rope-extend lacks: a named refusal (it
    used to fail with an AttributeError on None)."""
    model = model_for("llama")
    record = {**SHIPPED["yarn"], "original_max_position_embeddings": L}
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "shipped": record}
    before = model.config.to_dict()
    with pytest.raises(RopeExtendError, match="rope_parameters.shipped .* not rope_type 'default'"):
        rope_extend.patch(model, "string", keep_shipped=True, **METHODS["string"])
    assert model.config.to_dict() == before and rope_extend.patched(model) is None


def test_transformers_dynamic_ntk_is_not_kept():
    """transformers' ``dynamic`` recomputes its base at every length; rope-extend's own dynamic follows a grid."""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    model = model_for("llama", rope_parameters=rope)
    with pytest.raises(UnsupportedModelError, match=r"ships rope_type 'dynamic', which rope-extend does not compute"):
        rope_extend.patch(model, "string", keep_shipped=True)
    assert rope_extend.patched(model) is None


@pytest.mark.parametrize(
    "family, message",
    [
        # queries times 1 + beta ln(1 + floor(p / original_max_position_embeddings)), read from rope_parameters
        ("ministral3", r"scales its queries by llama_4_scaling_beta over rope_parameters' original_max_position"),
        # MLA: softmax scale times mscale(factor, mscale_all_dim)^2, read from rope_parameters at build
        ("mistral4", r"Mistral4Config's attention \(MLA\) builds its softmax scale from rope_parameters' factor"),
    ],
)
def test_families_that_read_the_shipped_keys_themselves_are_refused(family, message):
    from tests.families.tiny import build

    model = build(family)
    with pytest.raises(UnsupportedModelError, match=rf"{family}: cannot apply 'string': keep_shipped keeps the .*"):
        rope_extend.patch(model, "string", keep_shipped=True, shifted_offset=32, local_window=8)
    with pytest.raises(UnsupportedModelError, match=message):
        rope_extend.patch(model, "string", keep_shipped=True, shifted_offset=32, local_window=8)
    assert rope_extend.patched(model) is None


def test_an_mscale_all_dim_no_attention_reads_is_kept():
    """Outside the MLA families YaRN's mscale / mscale_all_dim is the rotary's attention factor only: kept."""
    rope = {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5}
    model = model_for("llama", rope_parameters={**rope, "original_max_position_embeddings": L, "rope_theta": 1e4})
    x = ids(n=60)
    scale = model.model.rotary_emb.attention_scaling
    assert scale == pytest.approx((1 + 0.1 * math.log(4)) / (1 + 0.05 * math.log(4)))
    want = reference_logits(model, "rerope", METHODS["rerope"], x)
    rope_extend.patch(model, "rerope", keep_shipped=True, **METHODS["rerope"])
    assert model.model.rotary_emb.attention_scaling == scale
    assert (run(model, x) - want).abs().max().item() < TOLERANCE


def test_a_config_rope_extend_rewrote_has_no_shipped_scaling_to_keep(tmp_path):
    model = shipped_model()
    rope_extend.patch(model, "yarn", factor=2)
    model.save_pretrained(tmp_path)
    again = type(model).from_pretrained(tmp_path, attn_implementation="sdpa")
    with pytest.raises(UnsupportedModelError, match=r"written by rope-extend \(yarn.*load the model's own config"):
        rope_extend.patch(again, "string", keep_shipped=True)


def test_gpt_oss_keeps_its_yarn_under_string():
    """GPT-OSS as transformers builds it (yarn x32 from 4096, attention sinks, sliding layers kept): the yarn
    frequencies stay bit for bit, cos and sin carry YaRN's factor times STRING's, and the logits equal the families'
    explicit reference (which turns keys with the rotary's frequencies, now the shipped ones)."""
    from tests.families.test_attention_families import METHODS as FAMILY_METHODS
    from tests.families.test_attention_families import N as FAMILY_N
    from tests.families.test_attention_families import _reference_logits
    from tests.families.tiny import build

    model = build("gpt_oss")
    rotary = model.model.rotary_emb
    yarn, mscale = rotary.inv_freq.clone(), rotary.attention_scaling
    params = FAMILY_METHODS["string"]
    rope_extend.patch(model, "string", keep_shipped=True, **params)
    assert rope_extend.patched(model).original_max_position_embeddings == 32 * 4096  # C: yarn x32 from 4096
    assert torch.equal(rotary.inv_freq, yarn) and mscale == pytest.approx(1 + 0.1 * math.log(32))
    assert rotary.attention_scaling == pytest.approx(mscale * STRING_FACTOR)
    x = torch.randint(3, 200, (1, FAMILY_N), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(input_ids=x).logits.float()
    want = _reference_logits(model, "string", params, x, False)
    assert (got - want).abs().max().item() < 2e-4 * want.abs().max().item()


def test_the_command_line_and_suites_take_it(tmp_path):
    """``--param keep_shipped=true`` writes the kept scaling into a saved model's config; a suite's or recipe's
    request with it on a frequency method is refused before any model loads."""
    import json

    from rope_extend.cli import main
    from rope_extend.scaling import ScalingRequest

    shipped_model().save_pretrained(tmp_path / "src")
    argv = ["configure", str(tmp_path / "src"), "--method", "string", "--param", "keep_shipped=true"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    rope = json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == "string" and rope["shipped"]["rope_type"] == "llama3"
    assert rope["original_max_position_embeddings"] == C  # STRING's defaults count from it when the model loads
    ScalingRequest(method="string", params={"keep_shipped": True}).check()
    with pytest.raises(RopeExtendError, match=r"rope.params.keep_shipped keeps the model's shipped rope scaling"):
        ScalingRequest(method="yarn", factor=2, params={"keep_shipped": True}).check(spell=lambda key: f"rope.{key}")


def test_gemma3_keeps_the_linear_scaling_of_its_global_layers():
    """Gemma 3 ships linear scaling on its full-attention layers only; the sliding layers keep their own rotary and
    window, the global ones keep the interpolated frequencies under the method."""
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    }
    model = model_for("gemma3", rope_parameters=rope)
    rotary = model.model.rotary_emb
    x = ids(n=100)
    linear = rotary.full_attention_inv_freq.clone()
    context = model.config.max_position_embeddings
    want = reference_logits(model, "self_extend", METHODS["self_extend"], x)
    rope_extend.patch(model, "self_extend", keep_shipped=True, **METHODS["self_extend"])
    # Gemma 3's config lists the extended context: C is max_position_embeddings, not the factor times it
    assert rope_extend.patched(model).original_max_position_embeddings == context
    assert torch.equal(rotary.full_attention_inv_freq, linear)
    assert model.config.rope_parameters["sliding_attention"] == rope["sliding_attention"]
    assert (run(model, x) - want).abs().max().item() < TOLERANCE


def test_the_shipped_context_of_a_linear_factor_follows_the_family():
    """A plain ``linear`` dict does not say which length it extends. Gemma 3 ships linear x8 on its global layers
    with ``max_position_embeddings`` = 131072, the extended context (so ``L`` = 16384 in linear's terms); a Vicuna-16k
    style Llama ships linear x4 with 4096, the length before it (``C`` = 16384). A factor counts from ``C``."""
    import transformers as T

    from rope_extend.hf.reading import original_length, shipped_context

    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    small = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    gemma = T.Gemma3TextConfig(
        **small, head_dim=32, num_hidden_layers=6, max_position_embeddings=131072, rope_parameters=rope
    )
    assert (original_length(gemma), shipped_context(gemma)) == (16384, 131072)
    model = T.Gemma3ForCausalLM(gemma).eval()
    rope_extend.patch(model, "yarn", factor=2)
    scaling = rope_extend.patched(model)
    assert (scaling.factor, scaling.original_max_position_embeddings) == (16, 16384)  # target 2 x 131072
    llama = T.LlamaConfig(
        **small,
        num_hidden_layers=1,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
    )
    assert (original_length(llama), shipped_context(llama)) == (4096, 16384)
