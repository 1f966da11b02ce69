"""NoPE hybrids (``hf.attention``'s planning and its log-n path): no silent no-op, and log-n on NoPE layers.

A NoPE hybrid whose RoPE layers are all local (sliding window or chunks) and whose other layers have no RoPE
(Cohere 2, EXAONE 4, Llama 4, AFMoE, Flint, ...) gives an attention method no layer to change: each is refused
before anything is touched, naming the layers. Frequency methods change the model's one frequency set, which
its local layers use. log-n scales the queries of every layer but the local ones, NoPE layers included: checked
against the explicit formula (prefill, cached decoding, left padding) and against Llama 4's own temperature
(``attn_temperature_tuning``), which transformers applies to the same layers; log-n on top of that temperature
is refused. A model none of whose layers reads the rotary embedding (every layer linear attention, a convolution
or NoPE) refuses the frequency methods too: they would change nothing.
"""

import copy
import inspect
import math

import pytest
import torch
from transformers import DynamicCache
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

import rope_extend
from rope_extend import UnsupportedModelError
from rope_extend.hf import attention as A
from rope_extend.hf import layout as Lo
from rope_extend.hf import rotary as R
from rope_extend.hf.attention import passes
from rope_extend.hf.attention import positions as query_positions
from rope_extend.hf.families.context import LOCAL_LAYER_TYPES
from rope_extend.hf.reading import rotary_geometry, text_config
from rope_extend.methods.attention import logn_scale
from tests.families.test_attention_families import _reference_logits
from tests.families.tiny import build, model_class, tiny_config
from tests.tiny import tiny_model

# every family of transformers' registry whose probe finds local RoPE layers and NoPE layers only (found with
# tiny.build and hf.layout.probe over rope_families(); the families sweep fails on any it misses: no-op cells)
NOPE_HYBRIDS = [
    f
    for f in (
        "afmoe",
        "aya_vision",
        "cohere2",
        "cohere2_moe",
        "cohere2_vision",
        "exaone4",
        "exaone4_5",
        "exaone_moe",
        "flint",
        "kolibri1",
        "lara_mini",
        "llama4_text",
        "muse_glimmer",
        "muse_spark",
    )
    if f in CONFIG_MAPPING_NAMES
]
ATTENTION = {
    "self_extend": dict(group_size=4, window=16),
    "dual_chunk": dict(chunk_size=48, local_window=8),
    "rerope": dict(window=16),
    "leaky_rerope": dict(window=16),
    "string": dict(shifted_offset=32, local_window=8),
}
LOGN = dict(factor=1, original_max_position_embeddings=16, logn=True)  # log-n alone, reaching ln 64 / ln 16
N = 64


def _config(model_type):
    return copy.deepcopy(tiny_config(model_type))  # tiny_config keeps one per family


def _ids(n=N, batch=1, seed=1):
    return torch.randint(3, 200, (batch, n), generator=torch.Generator().manual_seed(seed))


def _logits(model, **kw):
    with torch.no_grad():
        return model(**kw).logits.float()


def _without_temperature(model):
    """Llama 4's own NoPE temperature off (config and the modules' copies), so that log-n may run."""
    for holder in (model.config, text_config(model.config), *model.modules()):
        if getattr(holder, "attn_temperature_tuning", False):
            holder.attn_temperature_tuning = False
    return model


def _layers(model):
    """``(local RoPE layers, NoPE layers, every probed layer)``: indices, by the probe and ``config.layer_types``."""
    config = text_config(model.config)
    found = Lo.layer_probes(model, config, [m for _, m in R.rotary_modules(model)], 128)
    types = config.layer_types
    local = {i for i, p in found.items() if p.kind == "rope" and types[i] in LOCAL_LAYER_TYPES}
    nope = {i for i, p in found.items() if p.kind == "nope"}
    return local, nope, found


# ------------------------------------------------------------------------------------------ no silent no-op
@pytest.mark.parametrize("model_type", NOPE_HYBRIDS)
def test_attention_methods_are_refused_on_nope_hybrids(model_type):
    model = build(model_type)
    config = text_config(model.config)
    local, nope, found = _layers(model)
    assert local and nope and local | nope == set(found)  # the family is what this test is about
    chunked = "chunked_attention" in config.layer_types
    reach = f"{config.attention_chunk_size}-token chunks" if chunked else f"a {config.sliding_window}-token window"
    reach = f"within {reach}"
    x = _ids()
    before, implementation = _logits(model, input_ids=x), config._attn_implementation
    for method, params in ATTENTION.items():
        for logn in (False, True):
            with pytest.raises(UnsupportedModelError) as err:
                rope_extend.patch(model, method, logn=logn, **params)
            message = str(err.value)
            assert "\n" not in message
            assert message.startswith(f"{model_type}: cannot apply {method!r}: ")
            if logn and model_type == "llama4_text":  # its own NoPE temperature is on: log-n would compound
                assert "attn_temperature_tuning" in message
                continue
            assert f"{method} has nothing to change" in message
            assert f"its RoPE layers attend {reach}" in message
            assert f"its {len(nope)} global layer{'s have' if len(nope) > 1 else ' has'} no RoPE" in message
            assert "log-n scales the NoPE layers" in message
    assert rope_extend.patched(model) is None
    assert config._attn_implementation == implementation
    assert torch.equal(_logits(model, input_ids=x), before)


@pytest.mark.parametrize("model_type", ["cohere2", "llama4_text", "exaone4"])
def test_frequency_methods_change_the_local_layers_of_a_nope_hybrid(model_type):
    """One flat frequency set, used by the local layers only: a frequency method scales it (as transformers does
    with the config it writes), a real change; the NoPE layers have nothing a frequency method could change."""
    model = build(model_type)
    config = text_config(model.config)
    x = _ids()
    before = _logits(model, input_ids=x)
    rope_extend.patch(model, "yarn", factor=4)
    (_, rotary), *others = R.rotary_modules(model)
    assert not others
    dim, base = rotary_geometry(config)
    want, _ = rope_extend.inv_freq("yarn", head_dim=dim, base=base, factor=4, original_max_position_embeddings=128)
    assert torch.equal(rotary.inv_freq, want)
    assert not torch.equal(_logits(model, input_ids=x), before)
    rope_extend.unpatch(model)
    assert torch.equal(_logits(model, input_ids=x), before)


# models none of whose layers reads the rotary embedding, built from a family whose layer types allow it (no such
# model is in transformers' registry at its defaults): every layer linear attention, every layer a short
# convolution, every layer NoPE by the family's own switch, every layer of the type a family leaves without RoPE
UNREAD = {
    "qwen3_next all linear attention": ("qwen3_next", "layer_types", "linear_attention", "(linear_attention) keep a"),
    "lfm2 all convolutions": ("lfm2", "layer_types", "conv", "(conv) keep a recurrent or convolution state"),
    "smollm3 no_rope_layers all 0": ("smollm3", "no_rope_layers", 0, "attention layers have no RoPE"),
    "cohere2 all full_attention": ("cohere2", "layer_types", "full_attention", "attention layers have no RoPE"),
}
FREQUENCY = {
    "linear": dict(factor=4),
    "yarn": dict(factor=4),
    "ntk": dict(factor=4),
    "llama3": dict(factor=4),
    "dynamic": dict(factor=4),
    "dynamic_yarn": dict(factor=4),
}


def _unread(model_type, key, value):
    config = _config(model_type)
    text = text_config(config)
    setattr(text, key, [value] * text.num_hidden_layers)
    torch.manual_seed(0)
    return model_class(model_type)._from_config(config).eval()


@pytest.mark.parametrize("case", UNREAD)
def test_frequency_methods_are_refused_where_no_layer_reads_the_rotary_embedding(case):
    """Every layer linear attention or convolution, or every layer NoPE: a frequency method was accepted and
    changed nothing (a patch that silently changes nothing). Refused before anything changes, in one line, by the
    probe's finding (no attention layer rotates, nothing else reads positions); the attention methods too."""
    model_type, key, value, what = UNREAD[case]
    model = _unread(model_type, key, value)
    config = text_config(model.config)
    x = _ids(24)
    before, rope = _logits(model, input_ids=x, use_cache=False), copy.deepcopy(config.rope_parameters)
    buffers = {name: b.clone() for _, m in R.rotary_modules(model) for name, b in R.buffers(m).items()}
    for method, params in FREQUENCY.items():
        with pytest.raises(UnsupportedModelError) as err:
            rope_extend.patch(model, method, **params)
        message = str(err.value)
        assert message.startswith(f"{model_type}: cannot apply {method!r}: no layer of it reads the rotary embedding (")
        assert what in message and message.endswith("so the patch would change nothing") and "\n" not in message
    with pytest.raises(UnsupportedModelError, match="nothing to change|no attention layer to change"):
        rope_extend.patch(model, "rerope", **ATTENTION["rerope"])
    assert rope_extend.patched(model) is None and config.rope_parameters == rope
    after = {name: b for _, m in R.rotary_modules(model) for name, b in R.buffers(m).items()}
    assert after.keys() == buffers.keys() and all(torch.equal(after[n], b) for n, b in buffers.items())
    assert torch.equal(_logits(model, input_ids=x, use_cache=False), before)


def test_one_layer_that_reads_the_rotary_embedding_is_enough():
    """The same models with their last layer back on RoPE take the method, and it changes the logits."""
    back = {"linear_attention": "full_attention", "conv": "full_attention", 0: 1, "full_attention": "sliding_attention"}
    for model_type, key, value, _ in UNREAD.values():
        config = _config(model_type)
        text = text_config(config)
        setattr(text, key, [value] * (text.num_hidden_layers - 1) + [back[value]])
        torch.manual_seed(0)
        model = model_class(model_type)._from_config(config).eval()
        x = _ids(24)
        before = _logits(model, input_ids=x, use_cache=False)
        rope_extend.patch(model, "yarn", factor=4, original_max_position_embeddings=8)
        assert not torch.equal(_logits(model, input_ids=x, use_cache=False), before), model_type


@pytest.mark.skipif("beam" not in CONFIG_MAPPING_NAMES, reason="no Beam in this transformers")
def test_a_nested_config_without_a_global_frequency_set_is_refused():
    """Beam keys its frequency sets by layer type and its full layers have none: nothing global to scale."""
    model = build("beam")
    with pytest.raises(UnsupportedModelError, match=r"beam: cannot apply 'yarn': .*no global .*no RoPE"):
        rope_extend.patch(model, "yarn", factor=4)


def test_a_partial_change_is_accepted():
    """SmolLM3: NoPE every 4th layer, global RoPE elsewhere: the method changes the RoPE layers."""
    model = build("smollm3")
    local, nope, found = _layers(model)
    assert nope and not local and len(found) > len(nope)
    x = _ids()
    before = _logits(model, input_ids=x)
    rope_extend.patch(model, "self_extend", **ATTENTION["self_extend"])
    planned = {m.layer_idx: m.__dict__[A.PLAN_ATTR] for m in model.modules() if A.PLAN_ATTR in m.__dict__}
    assert {i for i, plan in planned.items() if plan.rules is not None} == set(found) - nope
    assert not torch.equal(_logits(model, input_ids=x), before)


def test_a_model_built_from_a_configured_config_is_refused_at_its_first_forward():
    config = rope_extend.configure(_config("cohere2"), "self_extend", **ATTENTION["self_extend"])
    torch.manual_seed(0)
    model = model_class("cohere2")(config).eval()
    with pytest.raises(UnsupportedModelError, match=r"cohere2: cannot apply 'self_extend': its RoPE layers attend"):
        model(input_ids=_ids(8))


# ------------------------------------------------------------------------------------------ log-n on NoPE layers
def _logn_model(model_type):
    model = _without_temperature(build(model_type))
    rope_extend.patch(model, "linear", **LOGN)
    return model


@pytest.mark.parametrize("model_type", ["cohere2", "llama4_text", "smollm3", "flint"])
def test_logn_scales_nope_layers_by_the_formula(model_type):
    """Prefill against the explicit reference: every non-local layer's query at ``p`` times
    ``max(1, ln(p + 1) / ln L)`` (tests/families' ``Reference``), NoPE layers included."""
    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"no {model_type} in this transformers")
    plain = _without_temperature(build(model_type))
    x = _ids()
    unscaled = _logits(plain, input_ids=x)
    model = _logn_model(model_type)
    _, nope, _ = _layers(plain)
    scaled = {m.layer_idx for m in model.modules() if A.PLAN_ATTR in m.__dict__ and m.__dict__[A.PLAN_ATTR].logn}
    assert nope and scaled >= nope
    got = _logits(model, input_ids=x)
    want = _reference_logits(model, "linear", {}, x, logn=True)
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) / scale < 2e-6
    assert float((got - unscaled).abs().max()) / scale > 1e-3  # log-n is at work (ln 64 / ln 16 = 1.5)
    assert rope_extend.patched(model).kernel == text_config(model.config)._rope_extend_inner  # queries scaled only


def _cache_name(model):
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _decode(model, ids, prompt):
    """Last-row logits of a prefill of ``prompt`` tokens, then of each step with the cache."""
    cache = DynamicCache(config=model.config)
    kw = {_cache_name(model): cache, "use_cache": True}
    steps = [_logits(model, input_ids=ids[:, :prompt], **kw)[:, -1]]
    for t in range(prompt, ids.shape[1]):
        steps.append(_logits(model, input_ids=ids[:, t : t + 1], **kw)[:, -1])
    return torch.stack(steps, 1)


@pytest.mark.parametrize("model_type", ["cohere2", "llama4_text", "smollm3"])
def test_logn_on_nope_layers_with_the_cache_and_left_padding(model_type):
    """Cached decoding equals the uncached forward; a left-padded row equals the row alone (log-n at its true
    positions: Llama 4's attention function gets no position ids, so the decoder's are kept for it)."""
    model = _logn_model(model_type)
    ids, pad = _ids(batch=2), 7
    full = _logits(model, input_ids=ids)
    scale = float(full.abs().max())
    steps = _decode(model, ids, 40)
    assert float((steps - full[:, 39:]).abs().max()) / scale < 2e-6
    padded = ids.clone()
    padded[0, :pad] = 0
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate gives them
    batch = _logits(model, input_ids=padded, attention_mask=mask, position_ids=positions)
    alone = _logits(model, input_ids=padded[:1, pad:])
    assert float((batch[0, pad:] - alone[0]).abs().max()) / scale < 2e-6
    assert float((batch[1] - full[1]).abs().max()) / scale < 2e-6


def _llama4(floor_scale=8, attn_scale=0.5):
    """A tiny Llama 4 text model whose temperature starts within a few tokens."""
    model = build("llama4_text")
    for holder in (model.config, *model.modules()):
        if hasattr(holder, "attn_temperature_tuning"):
            holder.floor_scale, holder.attn_scale = floor_scale, attn_scale
    return model


def test_logn_path_against_llama4_own_temperature(monkeypatch):
    """rope-extend's NoPE query temperature, driven with Llama 4's formula ``1 + attn_scale ln(1 + floor((p + 1) /
    floor_scale))``, on the model with its own temperature off, equals transformers' Llama 4 with it on: the
    same layers (NoPE, not the chunked RoPE ones), the same positions, prefill and cached decoding."""
    model = _llama4()
    ids = _ids(batch=1)
    assert model.config.attn_temperature_tuning
    want, want_steps = _logits(model, input_ids=ids), _decode(model, ids, 40)
    _without_temperature(model)
    plain = _logits(model, input_ids=ids)
    assert float((want - plain).abs().max()) > 1e-3  # the temperature matters here

    def llama4_temperature(positions, _length):
        return torch.log1p(torch.floor((positions.float() + 1.0) / 8)) * 0.5 + 1.0

    for part in (passes, query_positions):  # the two readers of logn_scale: the method layers and log-n alone
        monkeypatch.setattr(part, "logn_scale", llama4_temperature)
    rope_extend.patch(model, "linear", factor=1, logn=True)
    scale = float(want.abs().max())
    assert float((_logits(model, input_ids=ids) - want).abs().max()) / scale < 2e-6
    assert float((_decode(model, ids, 40) - want_steps).abs().max()) / scale < 2e-6


def test_logn_on_llama4_own_temperature_is_refused():
    model = _llama4()
    x = _ids()
    before = _logits(model, input_ids=x)
    own = r"llama4_text: cannot apply 'linear': its NoPE layers already scale their queries by Llama 4's temperature"
    with pytest.raises(UnsupportedModelError, match=own + r".*1 \+ 0\.5 ln\(1 \+ floor\(\(p \+ 1\) / 8\)\).*compound"):
        rope_extend.patch(model, "linear", factor=1, logn=True)
    with pytest.raises(UnsupportedModelError, match="attn_temperature_tuning"):
        rope_extend.configure(_config("llama4_text"), "yarn", factor=4, logn=True)
    # the config turned off after loading, the modules still on: refused all the same
    model.config.attn_temperature_tuning = False
    with pytest.raises(UnsupportedModelError, match="compound"):
        rope_extend.patch(model, "linear", factor=1, logn=True)
    assert rope_extend.patched(model) is None
    assert torch.equal(_logits(model, input_ids=x), before)
    rope_extend.patch(model, "yarn", factor=4)  # without log-n, Llama 4's temperature stays
    assert all(m.attn_temperature_tuning for m in model.modules() if hasattr(m, "use_rope"))


def test_logn_from_a_configured_config_keeps_the_decoder_positions():
    """Built from a config naming log-n, probed at the first forward: the NoPE layers get the decoder's positions
    from that very forward on."""
    config = _config("llama4_text")
    config.attn_temperature_tuning = False
    rope_extend.configure(config, "linear", **LOGN)
    torch.manual_seed(0)
    built = model_class("llama4_text")(config).eval()
    model = _logn_model("llama4_text")
    built.load_state_dict(model.state_dict())
    ids, pad = _ids(batch=2), 7
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    got = _logits(built, input_ids=ids, attention_mask=mask, position_ids=positions)
    want = _logits(model, input_ids=ids, attention_mask=mask, position_ids=positions)
    assert float((got - want).abs().max()) / float(want.abs().max()) < 2e-6


# ------------------------------------------------------------------------------------------ the probe
def test_a_layer_with_zero_keys_is_judged_by_its_queries():
    """A layer whose keys are all zero on the probe (ZAYA's tiny model) is not NoPE for that: its queries rotate."""
    model = tiny_model("llama")
    config = model.config
    rotary = [model.model.rotary_emb]
    layer = model.model.layers[0].self_attn
    with torch.no_grad():
        layer.k_proj.weight.zero_()
    found = Lo.layer_probes(model, config, rotary, 128)
    assert found[0].kind == "rope" and found[0].layout.pairing == "half"
    with torch.no_grad():
        layer.q_proj.weight.zero_()
    found = Lo.layer_probes(model, config, rotary, 128)
    assert found[0].kind == "unknown" and "zero" in found[0].why
    assert found[1].kind == "rope"


def test_logn_formula_itself():
    positions = torch.tensor([0, 15, 16, 63, 255])
    want = [max(1.0, math.log(p + 1) / math.log(16)) for p in positions.tolist()]
    assert torch.allclose(logn_scale(positions, 16), torch.tensor(want))
