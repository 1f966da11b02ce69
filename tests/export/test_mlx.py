"""The ``mlx`` export target (mlx-lm 0.32.2) and the audit's model of mlx-lm, without mlx: the keys each method is
written as, what is refused and why, a transformers round trip, and ``audit --engine mlx`` on the exports and on a
folder transformers 5 saved (which mlx-lm's llama reads at base 10000). mlx-lm itself running the exports is
``test_mlx_engine.py`` (marker ``mlx``, in the MLX venv)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers as T

import rope_extend
from rope_extend.cli import main
from rope_extend.errors import RopeExtendError, UnsupportedModelError
from rope_extend.export import export
from rope_extend.export.audit import audit
from rope_extend.export.audit import mlx as mlx_audit
from tests.tiny import tiny_model, tiny_tokenizer

LONGROPE = {"short_factor": [1.0 + i / 64 for i in range(8)], "long_factor": [1.0 + i / 2 for i in range(8)]}


def saved(tmp_path, family="llama", **overrides):
    folder = tmp_path / f"model-{family}"
    tiny_model(family, **overrides).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def config_of(folder):
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize(
    ("method", "params", "want"),
    [
        ("linear", {}, {"rope_type": "linear", "factor": 4.0}),
        (
            "yarn",
            {},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32.0,
             "beta_slow": 1.0},
        ),
        (  # transformers' attention_factor as mlx-lm's mscale: 0.1 * m * ln 4 + 1 = 1.3
            "yarn",
            {"attention_factor": 1.3},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": 0.3 / (0.1 * math.log(4)), "attention_factor": 1.3},
        ),
        (  # YaRN with the attention factor 1: mscale 0
            "ntk_by_parts",
            {},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": 0.0, "attention_factor": 1.0},
        ),
        (
            "llama3",
            {},
            {"rope_type": "llama3", "factor": 4.0, "original_max_position_embeddings": 256, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0},
        ),
    ],
)  # fmt: skip
def test_keys_mlx_lm_reads(tmp_path, method, params, want):
    folder = saved(tmp_path)
    result = export(str(folder), "mlx", tmp_path / "out", method=method, factor=4, **params)
    config = config_of(tmp_path / "out")
    assert "rope_parameters" not in config  # llama and qwen2 in mlx-lm never read it
    assert config["rope_scaling"] == pytest.approx(want) and config["rope_theta"] == 10000.0
    assert config["max_position_embeddings"] == 1024
    assert result.command == f"mlx_lm.server --model {tmp_path / 'out'}" and result.engine == "mlx-lm 0.32.2"
    assert (tmp_path / "out" / "tokenizer.json").is_file() and (tmp_path / "out" / "model.safetensors").is_file()
    scale = params.get("attention_factor", 0.1 * math.log(4) + 1 if method == "yarn" else 1.0)
    assert mlx_audit.rope(32, 10000.0, config["rope_scaling"], 1024, 1024)[1] == pytest.approx(scale, rel=1e-12)


def test_plain_and_ntk_are_the_top_level_base(tmp_path):
    folder = saved(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    export(str(folder), "mlx", tmp_path / "none")
    config = config_of(tmp_path / "none")
    assert config["rope_theta"] == 500000.0 and "rope_scaling" not in config and "rope_parameters" not in config
    export(str(folder), "mlx", tmp_path / "ntk", method="ntk", factor=4)
    assert config_of(tmp_path / "ntk")["rope_theta"] == pytest.approx(500000.0 * 4 ** (16 / 14))


def test_longrope_is_approximate_and_its_scale_comes_from_the_length(tmp_path):
    folder = saved(tmp_path, head_dim=16)
    with pytest.raises(RopeExtendError, match=r"^mlx-lm 0.32.2 serves longrope only approximately: .*long factors"):
        export(str(folder), "mlx", tmp_path / "a", method="longrope", factor=4, **LONGROPE)
    export(str(folder), "mlx", tmp_path / "b", method="longrope", factor=4, approximate=True, **LONGROPE)
    config = config_of(tmp_path / "b")
    assert (
        config["rope_scaling"]["long_factor"] == LONGROPE["long_factor"] and config["max_position_embeddings"] == 1024
    )
    with pytest.raises(RopeExtendError) as info:
        export(str(folder), "mlx", tmp_path / "c", method="longrope", factor=4, attention_factor=1.5, **LONGROPE)
    assert str(info.value) == (
        "mlx-lm 0.32.2 cannot serve longrope: its SuScaledRoPE scales by sqrt(1 + ln(N / L) / ln L) = 1.11803 at "
        "this factor and reads no attention_factor (1.5 here); nearest that exports: longrope without attention_factor"
    )
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    ("method", "params", "message"),
    [
        ("yarn", {"factor": 4, "truncate": False}, ("cannot serve yarn: its YarnRoPE always floors and ceils the "
         "ramp ends (truncate is not read); nearest that exports: yarn with truncate=true")),
        ("rerope", {}, ("cannot serve rerope: it has no attention that changes positions per query and key; nearest "
         "that exports: yarn with a factor (target length / L)")),
        ("dynamic", {"factor": 4}, "serves dynamic only approximately: dynamic NTK made static at the target 1024"),
    ],
)  # fmt: skip
def test_what_mlx_lm_cannot_say_is_refused(tmp_path, method, params, message):
    with pytest.raises(RopeExtendError) as info:
        export(str(saved(tmp_path)), "mlx", tmp_path / "out", method=method, **params)
    assert str(info.value).startswith(f"mlx-lm 0.32.2 {message}")
    assert not (tmp_path / "out").exists()


def test_families_mlx_lm_does_not_scale_are_refused(tmp_path, capsys):
    folder = saved(tmp_path, "gemma2", head_dim=16)
    code = main(
        ["export", str(folder), "--to", "mlx", "--method", "yarn", "--factor", "4", "--out", str(tmp_path / "o")]
    )
    err = [
        line for line in capsys.readouterr().err.splitlines() if line and not line.startswith("Writing model shards")
    ]
    assert code == 2 and len(err) == 1 and not (tmp_path / "o").exists()
    assert "exports are checked for llama, mistral, qwen2, qwen3 (whose mlx-lm classes read rope_theta and " in err[0]
    assert err[0].endswith("not 'gemma2'")
    with pytest.raises(RopeExtendError, match=r"^mlx-lm loads the tokenizer from the folder: pass tokenizer= with"):
        export(tiny_model("llama"), "mlx", tmp_path / "t", method="yarn", factor=4)
    assert not (tmp_path / "t").exists()
    windowed = saved(tmp_path, "mistral", sliding_window=512)
    with pytest.raises(UnsupportedModelError, match=r"mistral with a 512-token sliding window shorter than .* 1024"):
        export(str(windowed), "mlx", tmp_path / "w", method="yarn", factor=4)


@pytest.mark.parametrize(
    ("method", "params"), [("yarn", {"attention_factor": 1.3}), ("ntk_by_parts", {}), ("llama3", {}), ("linear", {})]
)
def test_transformers_reads_the_same_model(tmp_path, method, params):
    """The folder is a transformers folder too: reloaded by transformers 5 it gives the patched logits (the
    ``attention_factor`` beside mlx-lm's ``mscale`` is what transformers reads)."""
    model = tiny_model("llama")
    ids = torch.randint(3, 500, (1, 700))  # past L = 256
    rope_extend.patch(model, method, factor=4.0, **params)
    with torch.no_grad():
        expected = model(ids).logits
    export(model, "mlx", tmp_path / "out", tokenizer=tiny_tokenizer())
    reloaded = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("family", "method", "params"),
    [
        ("llama", "none", {}),
        ("llama", "yarn", {"attention_factor": 1.3}),
        ("llama", "llama3", {}),
        ("llama", "linear", {}),
        ("qwen2", "yarn", {}),
        ("qwen3", "ntk_by_parts", {}),
    ],
)
def test_audit_of_the_export_is_equal(tmp_path, family, method, params):
    options = {} if method == "none" else {"method": method, "factor": 4, **params}
    export(str(saved(tmp_path, family)), "mlx", tmp_path / "out", **options)
    report = audit(tmp_path / "out", engine="mlx")
    assert report.exit_code == 0 and report.engine == "mlx-lm 0.32.2", report.text()
    assert report.reference == "transformers on the same config"


def test_audit_of_a_transformers5_folder_finds_the_default_base(tmp_path, capsys):
    """transformers 5 saves the base inside ``rope_parameters``, which mlx-lm 0.32.2's llama and qwen2 do not read:
    they run at their default base (10000, 1e6) and unscaled. qwen3 reads it."""
    llama = saved(tmp_path, "llama", rope_parameters={"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0})
    assert "rope_theta" not in config_of(llama)
    assert main(["audit", str(llama), "--engine", "mlx"]) == 1
    out = capsys.readouterr().out
    assert (
        "mlx-lm 0.32.2 (llama): default, theta 10000;" in out
        and "MISMATCH: 7 of 8 frequencies differ" in out
        and "MISMATCH: cos/sin scale 1 vs 1.13863" in out
    )
    assert "warning: mlx-lm 0.32.2's llama reads the top-level rope_theta and rope_scaling, not rope_parameters " in out
    assert "it runs at base 10000, unscaled\n" in out
    qwen2 = saved(tmp_path, "qwen2", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    report = audit(qwen2, engine="mlx")
    assert report.exit_code == 1 and "theta 1e+06" in report.groups[0].engine.what
    qwen3 = saved(tmp_path, "qwen3", rope_parameters={"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0})
    assert audit(qwen3, engine="mlx").exit_code == 0


def test_audit_refuses_what_mlx_lm_does_not_load(tmp_path):
    folder = saved(tmp_path)
    config = config_of(folder)
    with pytest.raises(RopeExtendError, match=r"--overrides is vLLM's or SGLang's override JSON"):
        audit(folder, engine="mlx", overrides={"rope_theta": 1e6})
    (folder / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "yarn"}}))
    with pytest.raises(
        RopeExtendError, match=r"config.json: mlx-lm 0.32.2 cannot load this yarn rope_scaling: it has no factor"
    ):
        audit(folder, engine="mlx")
    (folder / "config.json").write_text(json.dumps({**config, "rope_scaling": {"type": "su", "factor": 2.0}}))
    with pytest.raises(RopeExtendError, match=r"does not model mlx-lm 0.32.2's rope type 'su'"):
        audit(folder, engine="mlx")
    (folder / "config.json").write_text(json.dumps({**config, "rope_theta": float("nan")}))
    with pytest.raises(RopeExtendError, match=r"rope_theta"):
        audit(folder, engine="mlx")
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gemma2"}))
    with pytest.raises(
        RopeExtendError, match=r"models mlx-lm 0.32.2's llama, mistral, qwen2, qwen3, not model_type 'gemma2'"
    ):
        audit(folder, engine="mlx")
