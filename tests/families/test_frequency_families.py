"""Frequency methods on every RoPE family of transformers' registry (``tests.families``: tiny random models).

``frequency_cell`` is one cell of the sweep (``test_families.py`` runs it on every family and checks the outcome
against the committed snapshot). For each family ``build`` makes and each method, either the patch is refused
before the model is touched, with a message that names the family and the method (and the family is listed in
``REFUSED``), or:

(a) every scaled frequency buffer equals the method's pure math (``rope_extend.inv_freq``) for its rotary dim
    and base, with proportional RoPE's zero frequencies still zero, and every other buffer (local layers,
    vision towers) is untouched; dynamic methods follow the length (``hf.rotary.bucket``);
(b) a forward runs and is finite;
(c) ``unpatch`` gives bit-identical logits;
(d) ``configure`` -> ``save_pretrained`` (the config; transformers validates it there) -> ``from_pretrained``
    gives the patched model's logits (atol 1e-5).

``L`` is set to 16 so that a 24-token input exercises the dynamic methods beyond it.
"""

from __future__ import annotations

import copy

import pytest
import torch

import rope_extend
from rope_extend import RopeExtendError, UnsupportedModelError
from rope_extend.hf import config as C
from rope_extend.hf import reading, rope_types
from rope_extend.hf import rotary as R
from rope_extend.hf.rotary import bucket, rotary_modules
from tests.families import snapshot
from tests.families.tiny import text_inputs

L, FACTOR, LENGTH = 16, 2.0, 24
METHODS = ("linear", "yarn", "dynamic", "llama3", "longrope")
# family -> (methods refused, or None for all; a word the reason contains)
REFUSED = {
    "beam": (None, "no RoPE"),  # its full-attention layers are NoPE; its sliding layers keep theirs
    "zamba2": (None, "no rotary embedding module"),  # use_mem_rope is off in its default config
    "recurrent_gemma": (None, "no max_position_embeddings"),  # Griffin: local attention (a window) only
    "cosmos3_edge": (None, "rope_type='default'"),  # its config's validate_architecture allows default only
    "ernie4_5_vl_moe": (None, "requires the `default` rope type"),  # its text rotary raises on any other
    # BLT's rotary modules belong to its byte encoder/decoder, global transformer and patcher sub-configs
    "blt": (None, "none of its rotary modules"),
    # transformers' longrope validator reads num_attention_heads, a per-layer attribute of this config
    "dots3_note": (("longrope",), "rejects the scaled rope_parameters"),
    "dots3_note_text": (("longrope",), "rejects the scaled rope_parameters"),
    # reads one attention scale per side of L from its config, and recomputes frequencies without the length
    "phimoe": (("dynamic_yarn", "longrope"), "PhimoeConfig"),
}


def _ids():
    torch.manual_seed(1)
    return torch.randint(3, 100, (1, LENGTH))


def _logits(model, family):
    with torch.no_grad():
        return model(**text_inputs(family, _ids())).logits


def _buffers(model) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{key}": value.detach().clone()
        for name, module in model.named_modules()
        if "RotaryEmbedding" in type(module).__name__
        for key, value in module._buffers.items()
        if value is not None and key.endswith("inv_freq") and not key.endswith("original_inv_freq")
    }


def _params(method, model) -> dict:
    """longrope's factor lists, one per frequency of the scaled buffers (8 where there are none)."""
    if method != "longrope":
        return {}
    try:
        rotary_modules(model)
    except UnsupportedModelError:
        return {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    text, mine = reading.text_config(model.config), {n for n, _ in rotary_modules(model)}
    sizes = [v.numel() for k, v in _buffers(model).items() if k.rsplit(".", 1)[0] in mine and _scaled(text, k)]
    sizes = sizes or [8]
    n = sizes[0]
    return {"short_factor": [1.0] * n, "long_factor": [1.0 + i / n for i in range(n)]}


def _layer_typed(model) -> bool:
    """Whether the model's scaled rotary keeps one frequency set per layer type."""
    try:
        return any(R.module_layer_types(m) != [None] for _, m in rotary_modules(model))
    except UnsupportedModelError:
        return False


def _layer_type(key: str) -> str | None:
    return key.rsplit(".", 1)[-1].removesuffix("inv_freq").removesuffix("_") or None


def _scaled(text, key: str) -> bool:
    return _layer_type(key) in reading.scaled_layer_types(text)


def _expected(method, params, config, key, before, seq_len=None):
    """The method's frequencies for the buffer ``key`` of a module built from ``config`` (zeros where
    proportional RoPE has them)."""
    lt = _layer_type(key)
    text = config
    base = reading.rope_dict(text, lt)["rope_theta"]
    n = before.numel()
    plain, _ = rope_extend.inv_freq("linear", 2 * n, base, 1.0, L)
    zero = before == 0
    if (
        rope_types.split_rope_type(rope_types.rope_type_of(reading.rope_dict(text, lt)))[1] == "default"
    ):  # the geometry is read right
        assert torch.equal(torch.where(zero, 0.0, plain), before), f"{key}: plain RoPE is not the model's buffer"
    freqs, scale = rope_extend.inv_freq(method, 2 * n, base, FACTOR, L, seq_len=seq_len, **params)
    return torch.where(zero, 0.0, freqs), scale


def frequency_cell(family, method) -> str:
    """The cell of a frequency method on ``family`` (``tests.families.sweep.Family``: its reloaded ``model``, whose
    logits are ``ref``): ``exact`` once (a)-(d) hold, (d) only where a plain reload reproduces the built model
    (``family.reproducible``), or the refusal; an AssertionError on anything else."""
    name, model, path, ref = family.name, family.model, family.path, family.ref
    before = _buffers(model)
    params = _params(method, model)
    methods, why = REFUSED.get(name, ((), ""))
    if method == "longrope" and R._LONGROPE_PER_LAYER_BUG and _layer_typed(model):
        methods, why = (method,), "fixed in transformers 5.21"
    if methods is None or method in methods:
        with pytest.raises((RopeExtendError, UnsupportedModelError)) as refused:
            rope_extend.patch(model, method, factor=FACTOR, original_max_position_embeddings=L, **params)
        message = str(refused.value)
        assert name in message and repr(method) in message and why in message, message
        assert rope_extend.patched(model) is None and torch.equal(_logits(model, name), ref)
        return snapshot.refused(message, name, method)

    configs = {n: copy.deepcopy(m.config) for n, m in rotary_modules(model)}  # each module's, unpatched
    rope_extend.patch(model, method, factor=FACTOR, original_max_position_embeddings=L, **params)
    try:
        # (a) before and after a forward beyond L
        text_modules = set(configs)
        modules = dict(model.named_modules())
        for forward in (False, True):
            if forward:
                out = _logits(model, name)
            after = _buffers(model)
            for key, old in before.items():
                owner = key.rsplit(".", 1)[0]
                if owner in text_modules and _scaled(configs[owner], key):
                    # dynamic methods: at the longest length the module saw (24, or a decoder's own positions)
                    seen = modules[owner].forward.entries[_layer_type(key)].seen if forward else None
                    seq_len = None if seen is None else bucket(seen, L)
                    expected, _ = _expected(method, params, configs[owner], key, old, seq_len)
                    assert torch.equal(after[key], expected), f"{name} {method}: {key} is not the method's math"
                else:
                    assert torch.equal(after[key], old), f"{name} {method}: {key} changed but is not scaled"
        # (b)
        assert torch.isfinite(out).all()
    finally:
        rope_extend.unpatch(model)
    # (c)
    assert torch.equal(_logits(model, name), ref), f"{name} {method}: unpatch is not bit-identical"
    assert all(torch.equal(v, before[k]) for k, v in _buffers(model).items())

    # (d)
    if family.reproducible:
        config = rope_extend.configure(
            copy.deepcopy(model.config), method, factor=FACTOR, original_max_position_embeddings=L, **params
        )
        config.save_pretrained(path / method)
        config = type(config).from_pretrained(path / method)
        reloaded = type(model).from_pretrained(path, config=config).eval()
        torch.testing.assert_close(_logits(reloaded, name), out, atol=1e-5, rtol=0)
    return snapshot.EXACT


# ------------------------------------------------------------------------------------------ family rules
def test_rewritten_rope_dict_keeps_family_keys_and_drops_the_old_types_own():
    """The old type's keys come from transformers' validator; every other key stays (llama_4_scaling_beta,
    mrope_section); a proportional layer stays proportional."""
    assert {"beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"} <= rope_types.rope_type_keys(
        "yarn"
    )
    old = {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 16.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.1,
        "mrope_section": [2, 3, 3],
    }
    scaling = rope_extend.get_method("linear")
    new = rope_types.scaled_rope_dict(old, C.scaling_for(_config(old), "linear", factor=2.0))
    # the shipped yarn x16 reaches 65536; linear x2 counts from there: 131072 = 32 x the pretraining 4096
    assert scaling.rope_type == new["rope_type"] == "linear" and new["factor"] == 32.0
    assert new["llama_4_scaling_beta"] == 0.1 and new["mrope_section"] == [2, 3, 3] and new["rope_theta"] == 1e6
    assert "beta_fast" not in new and "mscale_all_dim" not in new
    assert new["original_max_position_embeddings"] == 4096  # the family reads it there (llama-4 scale)
    prop = {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25}
    new = rope_types.scaled_rope_dict(prop, C.scaling_for(_config(prop), "yarn", factor=2.0))
    assert new["rope_type"] == "proportional_yarn" and new["partial_rotary_factor"] == 0.25


def _config(rope):
    import transformers as T

    return T.LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=4096, rope_parameters=copy.deepcopy(rope)
    )


def _deepseek(rope, max_position_embeddings):
    import transformers as T

    config = T.DeepseekV3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=copy.deepcopy(rope),
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return T.DeepseekV3ForCausalLM(config).eval()


def test_mla_yarn_softmax_scale_follows_the_rope_dict(tmp_path):
    """DeepSeek-style attention multiplies its softmax scale by mscale(s, mscale_all_dim)^2 when it is built
    (yarn_apply_mscale). A rope-extend yarn with the shipped numbers gives transformers' own logits; another
    yarn replaces that temperature instead of adding to it, and the reloaded model equals the patched one."""
    shipped = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }
    x = torch.randint(3, 100, (1, 100))

    def out(model):
        with torch.no_grad():
            return model(x).logits

    reference = _deepseek(shipped, 128)
    expected = out(reference)
    plain = _deepseek({"rope_type": "default", "rope_theta": 10000.0}, 32)
    before = out(plain)
    rope_extend.patch(plain, "yarn", factor=4, mscale=1.0, mscale_all_dim=1.0)
    torch.testing.assert_close(out(plain), expected, atol=1e-6, rtol=0)
    rope_extend.unpatch(plain)
    assert torch.equal(out(plain), before)

    scale = reference.model.layers[0].self_attn.scaling
    rope_extend.patch(reference, "yarn", factor=4)  # plain yarn: temperature on cos/sin only, once
    assert reference.model.layers[0].self_attn.scaling == 32**-0.5 != scale
    patched = out(reference)
    rope_extend.unpatch(reference)
    assert reference.model.layers[0].self_attn.scaling == scale and torch.equal(out(reference), expected)
    reference.save_pretrained(tmp_path)
    config = rope_extend.configure(copy.deepcopy(reference.config), "yarn", factor=4)
    reloaded = type(reference).from_pretrained(tmp_path, config=config).eval()
    torch.testing.assert_close(out(reloaded), patched, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", ["linear", "ntk", "dynamic", "yarn", "dynamic_yarn", "llama3"])
def test_phi3_config_saves_and_reloads_every_method(tmp_path, method):
    """Phi-3's config accepted only default and longrope (and renamed yarn to longrope on load)."""
    import transformers as T

    config = T.Phi3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = T.Phi3ForCausalLM(config).eval()
    x = torch.randint(3, 100, (1, 48))
    rope_extend.patch(model, method, factor=2)
    with torch.no_grad():
        patched = model(x).logits
    model.save_pretrained(tmp_path)
    reloaded = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.rope_parameters["rope_type"] == rope_extend.get_method(method).rope_type
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, patched, atol=1e-5, rtol=0)
    with pytest.raises(Exception, match="longrope"):  # Phi-3's own check still runs on other types
        T.Phi3Config(rope_parameters={"rope_type": "proportional", "rope_theta": 1e4})
