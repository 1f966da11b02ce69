"""Registration with transformers, `configure`, and save/reload round trips."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers as T
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import rope_extend
from rope_extend import RopeExtendError
from tests.tiny import FAMILIES, tiny_config, tiny_model

L = 256


def ids(n=700):
    torch.manual_seed(2)
    return torch.randint(3, 512, (1, n))


def logits(model, x):
    with torch.no_grad():
        return model(x).logits


def test_own_types_are_registered():
    for rope_type in ("ntk", "dynamic_ntk", "ntk_by_parts", "dynamic_yarn"):
        assert rope_type in ROPE_INIT_FUNCTIONS
    assert ROPE_INIT_FUNCTIONS["yarn"].__module__.startswith("transformers")  # transformers' own are kept


@pytest.mark.parametrize(
    "rope_type,extra",
    [
        ("ntk", {}),
        ("ntk", {"alpha": 3.0}),
        ("dynamic_ntk", {}),
        ("ntk_by_parts", {"beta_fast": 16.0}),
        ("dynamic_yarn", {}),
        ("dynamic_yarn", {"finetuned": True}),
    ],
)
def test_config_with_an_own_type_builds_saves_and_reloads(tmp_path, rope_type, extra):
    params = {
        "rope_type": rope_type,
        "factor": 4.0,
        "original_max_position_embeddings": L,
        "rope_theta": 10000.0,
        **extra,
    }
    config = tiny_config(rope_parameters=params, max_position_embeddings=4 * L)
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(config).eval()
    x = ids()
    before = logits(model, x)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_parameters"]["rope_type"] == rope_type
    reloaded = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(logits(reloaded, x), before)
    method = next(m for m in rope_extend.method_names() if rope_extend.get_method(m).rope_type == rope_type)
    kwargs = {k: v for k, v in extra.items()}
    from rope_extend.hf.rotary import bucket  # dynamic frequencies follow the length on a grid beyond L

    expected = rope_extend.inv_freq(
        method, 16, 10000.0, 4.0, L, seq_len=bucket(700, L) if "dynamic" in rope_type else None, **kwargs
    )[0]
    assert torch.equal(reloaded.model.rotary_emb.inv_freq, expected)


@pytest.mark.parametrize(
    "params,needle",
    [
        ({"rope_type": "ntk_by_parts", "factor": 4.0, "beta_fats": 3}, "beta_fats"),
        ({"rope_type": "ntk", "factor": 0.5}, "factor must be >= 1"),
        ({"rope_type": "dynamic_yarn", "factor": 2.0, "beta_fast": 1, "beta_slow": 2}, "beta_fast must be greater"),
        ({"rope_type": "ntk"}, "needs a factor"),
    ],
)
def test_invalid_own_type_config_is_an_error(params, needle):
    with pytest.raises(Exception, match=needle):
        tiny_config(rope_parameters={"rope_theta": 10000.0, **params})


@pytest.mark.parametrize("method", rope_extend.method_names())
def test_patched_model_saves_and_reloads_with_identical_logits(tmp_path, method):
    model = tiny_model()
    params = (
        {"short_factor": [1.0] * 8, "long_factor": [float(i + 2) for i in range(8)]} if method == "longrope" else {}
    )
    factor = 3
    if method == "string":  # reaches L + shifted_offset - local_window < 2L
        factor, params = 1.5, {"shifted_offset": 200, "local_window": 8}
    rope_extend.patch(model, method, factor=factor, **params)
    x = ids(int(factor * L))
    before = logits(model, x)
    model.save_pretrained(tmp_path)
    reloaded = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.max_position_embeddings == int(factor * L)
    assert reloaded.config.original_max_position_embeddings == L
    assert torch.equal(logits(reloaded, x), before)


def test_transformers_own_types_reload_in_plain_transformers(tmp_path):
    """linear/yarn/llama3/longrope written by rope-extend load without rope-extend, with the same logits."""
    x = ids(600)
    expected = {}
    for method in ("linear", "yarn", "llama3", "longrope"):
        model = tiny_model()
        params = (
            {"short_factor": [1.0] * 8, "long_factor": [float(i + 2) for i in range(8)]} if method == "longrope" else {}
        )
        rope_extend.patch(model, method, factor=4, **params)
        model.save_pretrained(tmp_path / method)
        expected[method] = logits(model, x)
    torch.save({"x": x, **expected}, tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import sys, logging, torch, transformers as T
        assert "rope_extend" not in sys.modules
        data = torch.load({str(tmp_path / "expected.pt")!r})
        for method in ("linear", "yarn", "llama3", "longrope"):
            model = T.AutoModelForCausalLM.from_pretrained({str(tmp_path)!r} + "/" + method).eval()
            with torch.no_grad():
                out = model(data["x"]).logits
            assert "rope_extend" not in sys.modules
            assert torch.equal(out, data[method]), (method, (out - data[method]).abs().max())
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
    assert "Unrecognized keys" not in result.stderr


# ------------------------------------------------------------------------------------------ configure
def test_configure_writes_rope_parameters_and_raises_max_positions():
    config = rope_extend.configure(tiny_config(), "yarn", factor=4, beta_fast=16.0)
    assert config.max_position_embeddings == 4 * L and config.original_max_position_embeddings == L
    assert config.rope_parameters == {
        "rope_theta": 10000.0,
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": L,
        "beta_fast": 16.0,
        "beta_slow": 1.0,
        "truncate": True,
    }


def test_configure_is_idempotent_and_does_not_compound():
    once = rope_extend.configure(tiny_config(), "yarn", factor=4)
    again = rope_extend.configure(rope_extend.configure(tiny_config(), "dynamic", factor=8), "yarn", factor=4)
    twice = rope_extend.configure(rope_extend.configure(tiny_config(), "yarn", factor=4), "yarn", factor=4)
    assert once.to_dict() == twice.to_dict() == again.to_dict()


def test_configure_target_length_and_explicit_original_length():
    config = rope_extend.configure(tiny_config(), "linear", target_length=1000)
    assert config.max_position_embeddings == 1000 and config.rope_parameters["factor"] == pytest.approx(1000 / L)
    config = rope_extend.configure(tiny_config(), "yarn", factor=2, original_max_position_embeddings=128)
    assert config.max_position_embeddings == 256 and config.rope_parameters["original_max_position_embeddings"] == 128


def test_configure_reads_the_original_length_from_the_config():
    shipped = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    config = rope_extend.configure(
        tiny_config(rope_parameters=shipped, max_position_embeddings=256), "linear", factor=2
    )
    # the factor counts from the 256 tokens the yarn x4 config ships with; the linear factor is then 512 / 64
    assert config.max_position_embeddings == 512 and config.original_max_position_embeddings == 64
    assert config.rope_parameters["factor"] == 8.0
    phi3 = rope_extend.configure(tiny_config("phi3", original_max_position_embeddings=128), "yarn", factor=2)
    assert phi3.max_position_embeddings == 256


def test_configure_on_a_composite_config_scales_the_text_config():
    config = T.Gemma3Config(
        text_config=tiny_config("gemma3").to_dict(),
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
    )
    rope_extend.configure(config, "yarn", factor=2)
    text = config.get_text_config()
    assert text.rope_parameters["full_attention"]["rope_type"] == "yarn"
    assert text.rope_parameters["sliding_attention"]["rope_type"] == "default"


def test_rope_parameters_helper():
    params = rope_extend.rope_parameters("ntk", factor=2, original_max_position_embeddings=4096, rope_theta=5e5)
    assert params == {"rope_theta": 5e5, "rope_type": "ntk", "factor": 2.0, "original_max_position_embeddings": 4096}
    with pytest.raises(RopeExtendError, match="unknown method"):
        rope_extend.rope_parameters("bogus", factor=2, original_max_position_embeddings=4096)


@pytest.mark.parametrize("family", ["mistral", "qwen3", "gemma2", "phi"])
def test_configured_families_build(family):
    config = rope_extend.configure(tiny_config(family), "ntk_by_parts", factor=2)
    model = FAMILIES[family][1](config).eval()
    assert logits(model, ids(600)).isfinite().all()


# ------------------------------------------------------------------ a config's geometry, checked before use
BAD_GEOMETRY = [
    ("head_dim", "16", "head_dim must be an integer >= 2, got '16'"),  # int("16") made it a head dim
    ("head_dim", float("nan"), "head_dim must be an integer >= 2, got nan"),  # int(nan): a ValueError
    ("head_dim", -16, "head_dim must be an integer >= 2, got -16"),
    ("head_dim", 16.5, "head_dim must be an integer >= 2, got 16.5"),  # int(16.5) made it 16
    ("rope_theta", "10000", "rope_theta must be a finite number, got '10000'"),  # float("10000") read a string
    ("rope_theta", "abc", "rope_theta must be a finite number, got 'abc'"),  # float("abc"): a ValueError
    ("rope_theta", float("nan"), "rope_theta must be a finite number, got nan"),
    ("rope_theta", 0, "rope_theta must be > 1.0, got 0"),
    ("rope_theta", -1.0, "rope_theta must be > 1.0, got -1.0"),
]


def _plant(config, field, value):
    """``value`` into the config as a config.json would hold it, past the config class's own type checks
    (transformers 5.24's strict dataclasses refuse it when it is set; a remote-code config has none)."""
    if field == "rope_theta":
        config.rope_parameters["rope_theta"] = value
    else:
        config.__dict__[field] = value


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3"])
@pytest.mark.parametrize("field, value, message", BAD_GEOMETRY)
def test_a_bad_head_dim_or_rope_theta_is_one_line_naming_it(family, field, value, message):
    """Planted in a tiny model's config, each is refused by ``patch`` in one line naming the field and what is
    allowed, and the model is left as it was."""
    model = tiny_model(family)
    _plant(model.config, field, value)
    before = model.model.rotary_emb.inv_freq.clone(), model.config.to_dict()
    with pytest.raises(RopeExtendError) as err:
        rope_extend.patch(model, "yarn", factor=2)
    assert str(err.value) == f"{family}: cannot apply 'yarn': {message}"
    assert torch.equal(model.model.rotary_emb.inv_freq, before[0]) and model.config.to_dict() == before[1]
    assert rope_extend.patched(model) is None


def test_an_unset_head_dim_is_read_as_transformers_reads_it():
    """``head_dim`` None or 0 is unset (transformers' rotary init reads ``head_dim or hidden // heads``): the
    frequencies are those of the model without one, so a zero is not refused; without it, the sizes it is made
    from are checked (``hidden_size`` a string was a TypeError)."""
    from rope_extend.hf.reading import head_dim

    plain = tiny_model("llama")
    zero = tiny_model("llama")
    zero.config.__dict__["head_dim"] = 0
    assert head_dim(zero.config) == head_dim(plain.config) == 16
    rope_extend.patch(plain, "yarn", factor=2)
    rope_extend.patch(zero, "yarn", factor=2)
    assert torch.equal(zero.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)
    config = tiny_config("llama")
    config.__dict__.update(head_dim=None, hidden_size="64")
    with pytest.raises(RopeExtendError, match=r"^hidden_size must be an integer >= 1, got '64'$"):
        head_dim(config)
    config.__dict__.update(hidden_size=64, num_attention_heads=0)
    with pytest.raises(RopeExtendError, match=r"^num_attention_heads must be an integer >= 1, got 0$"):
        head_dim(config)


@pytest.mark.parametrize("value, message", [(v, m) for f, v, m in BAD_GEOMETRY if f == "rope_theta"][:4])
def test_configure_refuses_a_bad_rope_theta_in_one_line(tmp_path, value, message):
    """Through ``python -m rope_extend configure`` on a saved folder whose config.json holds it (a string passes
    transformers' own config checks: ``"10000"`` was written into the new config as a string, ``"abc"`` was a
    traceback): exit 2, one line, nothing written."""
    folder = tmp_path / "model"
    tiny_config("llama").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = value
    (folder / "config.json").write_text(json.dumps(config))
    before = (folder / "config.json").read_bytes()
    out = tmp_path / "scaled"
    cmd = [sys.executable, "-m", "rope_extend", "configure", str(folder), "--method", "yarn", "--factor", "2"]
    proc = subprocess.run([*cmd, "--out", str(out)], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"rope-extend: error: llama: cannot apply 'yarn': {message}"
    assert not out.exists() and (folder / "config.json").read_bytes() == before


TOO_LONG = "must be <= 2**40 = 1099511627776 tokens (longer than any sequence a model can be run on)"
BAD_LENGTHS = [
    ("4096", "must be an integer >= 2, got '4096'"),  # int("4096") made it a length
    (float("nan"), "must be an integer >= 2, got nan"),  # int(nan): a ValueError
    (4096.5, "must be an integer >= 2, got 4096.5"),  # int() truncated it
    (1, "must be an integer >= 2, got 1"),  # LongRoPE's scale and log-n divide by ln L = 0
    (10**5000, f"{TOO_LONG}, got <an integer of 16610 bits>"),  # float(s * L): an OverflowError
    (2**40 + 1, f"{TOO_LONG}, got 1099511627777"),
]


@pytest.mark.parametrize("value, message", BAD_LENGTHS, ids=["string", "nan", "fraction", "one", "huge", "past"])
def test_a_bad_original_length_in_a_config_is_one_line_naming_it(value, message):
    """``hf.reading.original_length`` checks ``L`` as the audit does (``check_original_length``), wherever the config
    keeps it: Phi-3's top-level attribute (refused by ``patch``, the model left as it was), a rope dict's key, and
    ``max_position_embeddings`` when there is neither."""
    from rope_extend.hf.reading import original_length

    model = tiny_model("phi3")
    model.config.__dict__["original_max_position_embeddings"] = value
    before = model.model.rotary_emb.inv_freq.clone(), model.config.to_dict()
    with pytest.raises(RopeExtendError) as err:
        rope_extend.patch(model, "yarn", factor=2)
    assert str(err.value) == f"phi3: cannot apply 'yarn': original_max_position_embeddings {message}"
    assert torch.equal(model.model.rotary_emb.inv_freq, before[0]) and model.config.to_dict() == before[1]
    config = tiny_config("llama")
    config.rope_parameters = {**config.rope_parameters, "rope_type": "yarn", "factor": 2.0}
    config.rope_parameters["original_max_position_embeddings"] = value
    with pytest.raises(RopeExtendError, match=r"^original_max_position_embeddings "):
        original_length(config)
    config = tiny_config("llama")
    config.__dict__["max_position_embeddings"] = value
    with pytest.raises(RopeExtendError) as err:
        original_length(config)
    assert str(err.value) == f"max_position_embeddings {message}"
    config.__dict__["max_position_embeddings"] = 2**40  # the longest length is a length
    assert original_length(config) == 2**40


@pytest.mark.parametrize(
    "value, message",
    [
        ("0.25", "must be a finite number, got '0.25'"),  # "0.25" * head_dim // 2: a TypeError
        (float("nan"), "must be a finite number, got nan"),  # int(nan): a ValueError
        (0.0, "must be > 0.0, got 0.0"),
        (1.5, r"must be in (0, 1], got 1.5"),  # 24 of 16 frequencies "rotating": all of them, silently
    ],
)
def test_a_bad_partial_rotary_factor_of_proportional_rope_is_one_line(value, message):
    """Gemma 4's full-attention layers (proportional RoPE) read ``partial_rotary_factor`` from their rope dict to
    count the frequencies that rotate (``hf.reading.rotating``), which never checked it; it is now read in one place
    (``reading.partial_rotary_factor``) and checked there, for ``rotating`` and ``rotary_geometry`` alike."""
    from rope_extend.hf import reading
    from tests.families.tiny import build

    model = build("gemma4_text")
    assert reading.rotating(model.config, "full_attention") == 4  # 0.25 x 32 / 2: as transformers counts them
    model.config.rope_parameters["full_attention"]["partial_rotary_factor"] = value
    before = {k: v.clone() for k, v in model.state_dict(keep_vars=False).items() if "inv_freq" in k}
    config = model.config.to_dict()
    with pytest.raises(RopeExtendError) as err:
        rope_extend.patch(model, "yarn", factor=2)
    assert str(err.value) == f"gemma4_text: cannot apply 'yarn': partial_rotary_factor {message}"
    for reader in (reading.rotating, reading.rotary_geometry):
        with pytest.raises(RopeExtendError, match=r"^partial_rotary_factor "):
            reader(model.config, "full_attention")
    after = {k: v for k, v in model.state_dict(keep_vars=False).items() if "inv_freq" in k}
    assert all(torch.equal(before[k], after[k]) for k in before) and model.config.to_dict() == config
