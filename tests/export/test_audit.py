"""``rope-extend audit``: files made wrong on purpose, one per kind of error users met, are found with the right
message and exit 1; rope-extend's own exports (gguf, vllm, sglang) pass with exit 0."""

from __future__ import annotations

import json

import pytest

from rope_extend.cli import main
from rope_extend.export import export
from tests.tiny import tiny_model, tiny_tokenizer

gguf = pytest.importorskip("gguf")
LONG = {"short_factor": [1.0 + i / 16 for i in range(8)], "long_factor": [1.0 + i / 2 for i in range(8)]}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("audit") / "base"  # Llama, head 16 (8 frequencies), L = 256, 2 layers
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def configured(base, tmp_path, method, **params):
    args = [f"--{k.replace('_', '-')}={v}" for k, v in params.items() if k == "factor"]
    args += [f"--param={k}={json.dumps(v)}" for k, v in params.items() if k != "factor"]
    out = tmp_path / f"ref-{method}"
    assert main(["configure", str(base), "--method", method, *args, "--out", str(out)]) == 0
    return out


def run(capsys, *args):
    capsys.readouterr()
    code = main(["audit", *map(str, args)])
    return code, capsys.readouterr().out


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("yarn", {"factor": 4}),
        ("linear", {"factor": 2}),
        ("llama3", {"factor": 4}),
        ("longrope", {"factor": 4, **LONG}),
    ],
)
@pytest.mark.parametrize("to", ["gguf", "vllm", "sglang"])
def test_own_exports_pass(base, tmp_path, capsys, method, params, to):
    ref = configured(base, tmp_path, method, **params)
    out = tmp_path / ("m.gguf" if to == "gguf" else "m")
    export(str(base), to, out, method=method, tokenizer_pre="smollm", approximate=method == "longrope", **params)
    code, text = run(capsys, out, "--reference", ref, *([] if to == "gguf" else ["--engine", to]))
    assert code == 0 and "result: equal" in text, text
    if method == "longrope":  # served past L: the long factors for every sequence, said as a warning
        assert "long factors for every sequence" in text, text


def write_gguf(path, arch="llama", layers=2, head=16, context=1024, n_rot=None, **rope):
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(context)
    w.add_block_count(layers)
    w.add_embedding_length(head * 4)
    w.add_head_count(4)
    w.add_rope_dimension_count(n_rot or head)
    for key, value in rope.items():
        name = f"{arch}.{key.replace('__', '.')}"
        if isinstance(value, str):
            w.add_string(name, value)
        elif isinstance(value, int):
            w.add_uint32(name, value)
        else:
            w.add_float32(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_qwen_style_yarn_written_as_linear(base, tmp_path, capsys):
    ref = configured(base, tmp_path, "yarn", factor=4)
    f = write_gguf(
        tmp_path / "m.gguf", rope__freq_base=10000.0, rope__scaling__type="linear", rope__scaling__factor=4.0
    )
    code, text = run(capsys, f, "--reference", ref)
    assert code == 1 and "YaRN is not there" in text and "cos/sin scale 1 vs 1.13863" in text, text


def test_gguf_that_lost_its_yarn_keys(base, tmp_path, capsys):
    ref = configured(base, tmp_path, "yarn", factor=4)
    f = write_gguf(tmp_path / "m.gguf", rope__freq_base=10000.0, rope__scaling__original_context_length=256)
    code, text = run(capsys, f)  # no reference: a warning, exit 0
    assert code == 0 and "scaling dropped?" in text, text
    code, text = run(capsys, f, "--reference", ref)
    assert code == 1 and "MISMATCH" in text and "YaRN is not there" in text, text


def test_wrong_original_length(base, tmp_path, capsys):
    ref = configured(base, tmp_path, "yarn", factor=4)
    keys = {"rope__freq_base": 10000.0, "rope__scaling__type": "yarn", "rope__scaling__factor": 4.0}
    f = write_gguf(tmp_path / "m.gguf", **keys)  # no original length: llama.cpp takes context_length 1024
    code, text = run(capsys, f, "--reference", ref)
    assert code == 1 and "frequencies differ" in text and "without rope.scaling.original_context_length" in text, text
    assert "likely: the original length differs: 1024 in the engine, 256 in the reference" in text, text
    good = write_gguf(tmp_path / "g.gguf", rope__scaling__original_context_length=256, **keys)
    assert run(capsys, good, "--reference", ref)[0] == 0


def test_a_cause_is_named_only_where_the_two_sides_differ(base, tmp_path, capsys):
    """YaRN x4 served against YaRN x8, both with original length 256: the factor is named, the original length
    (equal on both sides) is not."""
    ref = configured(base, tmp_path, "yarn", factor=8)
    keys = {"rope__scaling__type": "yarn", "rope__scaling__factor": 4.0, "rope__scaling__original_context_length": 256}
    code, text = run(capsys, write_gguf(tmp_path / "m.gguf", rope__freq_base=10000.0, **keys), "--reference", ref)
    assert code == 1 and "likely: the factor differs: x4 in the engine, x8 in the reference" in text, text
    assert "original length" not in text and "original_context_length" not in text, text


def test_wrong_number_of_frequencies(base, tmp_path, capsys):
    """Gemma 4's proportional RoPE as a converter got it wrong: fewer rotated dimensions than transformers."""
    f = write_gguf(tmp_path / "m.gguf", n_rot=8, rope__freq_base=10000.0)
    code, text = run(capsys, f, "--reference", base)
    assert code == 1 and "rotates 8 dimensions (4 frequencies) where the reference rotates 16 (8)" in text, text


def test_longrope_switch_from_the_allocated_context(base, tmp_path, capsys):
    ref = configured(base, tmp_path, "longrope", factor=4, **LONG)
    out = tmp_path / "v"
    export(str(base), "vllm", out, method="longrope", factor=4, approximate=True, **LONG)
    code, text = run(capsys, out, "--engine", "vllm", "--reference", ref, "--length", 200)
    assert code == 0 and "long factors" not in text, text  # served within L: short factors on both sides
    code, text = run(capsys, out, "--engine", "vllm", "--reference", ref, "--length", 2048)
    assert code == 0 and "long factors for every sequence (served context 2048 > original 256)" in text, text


def gemma3(tmp_path, name, local, **top):
    config = tiny_model("gemma3").config.to_dict()
    config["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_theta": 10000.0, **local},
    }
    config.update(top)
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_gemma3_linear_factor_on_local_layers(tmp_path, capsys):
    ref = gemma3(tmp_path, "ref", {"rope_type": "default"})
    bad = gemma3(tmp_path, "bad", {"rope_type": "linear", "factor": 8.0})
    code, text = run(capsys, bad)
    assert code == 0 and "sliding_attention layers have linear x8.0" in text, text
    for engine in ("transformers", "vllm"):
        code, text = run(capsys, bad, "--engine", engine, "--reference", ref)
        assert code == 1 and "a scaling on local (sliding-window) layers" in text, text
        assert "(full_attention): " in text and text.count("MISMATCH:") >= 1, text
    assert run(capsys, ref, "--reference", ref)[0] == 0


def test_gpt_oss_yarn_without_truncate(tmp_path, capsys):
    from transformers import GptOssConfig

    rope = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
    kw = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    for name, extra in (("ref", {"truncate": False}), ("bad", {})):
        cfg = GptOssConfig(**kw, max_position_embeddings=131072, rope_parameters={**rope, **extra})
        cfg.save_pretrained(tmp_path / name)
    code, text = run(capsys, tmp_path / "bad", "--reference", tmp_path / "ref")
    assert code == 1 and "truncate=false" in text and "frequencies differ" in text, text


def test_sglang_ignores_attention_factor(base, tmp_path, capsys):
    folder = tmp_path / "s"
    export(str(base), "vllm", folder, method="yarn", factor=4, attention_factor=1.5)  # vLLM's keys only
    code, text = run(capsys, folder, "--engine", "sglang")
    assert code == 1 and "SGLang ignores attention_factor 1.5" in text, text
    assert run(capsys, folder, "--engine", "vllm")[0] == 0


def test_overrides_are_read_as_the_engine_reads_them(base, capsys):
    """The override JSON replaces the folder's rope dict (vLLM's --hf-overrides); --json gives the same report."""
    over = json.dumps({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}})
    code, text = run(capsys, base, "--engine", "vllm", "--overrides", over, "--json")
    report = json.loads(text)
    assert code == 0 and report["result"] == "equal" and report["layers"][0]["scale"] == pytest.approx(1.1386294)
    assert run(capsys, base, "--engine", "vllm", "--overrides", "[1]")[0] == 2


def test_unreadable_paths(tmp_path, capsys):
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x00")
    for path, message in ((tmp_path / "none", "does not exist"), (tmp_path / "bad.gguf", "not a readable GGUF")):
        capsys.readouterr()
        assert main(["audit", str(path)]) == 2
        assert message in capsys.readouterr().err


def with_rope(base, tmp_path, name, rope):
    config = json.loads((base / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_vllm_dynamic_is_plain_rope(base, tmp_path, capsys):
    """vLLM 0.33.0's dynamic without max_trained_positions is plain RoPE in a table of N rows, served to factor x N
    (its get_rope, tests/export/test_audit_vllm_sglang.py): a mismatch; SGLang's static NTK at factor x N is equal."""
    folder = with_rope(base, tmp_path, "d", {"rope_type": "dynamic", "factor": 2.0})
    code, text = run(capsys, folder, "--engine", "vllm")
    assert code == 1 and "frequencies differ" in text and "vLLM's dynamic is plain RoPE" in text, text
    assert "positions past 256 have no rotary entries" in text, text
    code, text = run(capsys, folder, "--engine", "sglang")
    assert code == 0 and "dynamic made static at 512 tokens" in text, text


def test_engines_ignore_a_longrope_attention_factor(base, tmp_path, capsys):
    """vLLM and SGLang read short_mscale / long_mscale only: a longrope dict's attention_factor (transformers') is
    not their scale; rope-extend's own engine exports write the mscales and pass (test_own_exports_pass)."""
    folder = with_rope(base, tmp_path, "l", {"rope_type": "longrope", "attention_factor": 1.5, **LONG})
    for engine in ("vllm", "sglang"):
        code, text = run(capsys, folder, "--engine", engine, "--length", 200)
        assert code == 1 and "cos/sin scale 1 vs 1.5" in text and "ignores a longrope attention_factor 1.5" in text


def test_integer_linear_factor_is_refused(base, tmp_path, capsys):
    folder = with_rope(base, tmp_path, "i", {"rope_type": "linear", "factor": 2})
    capsys.readouterr()
    assert main(["audit", str(folder), "--engine", "vllm"]) == 2
    assert "factor 2 is an integer" in capsys.readouterr().err
    assert run(capsys, folder)[0] == 0  # transformers itself takes it
