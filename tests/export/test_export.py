"""Exports of tiny models: configs each engine reads, a transformers-4 round trip, GGUF files read back, and
bad input (one line, exit 2, nothing written)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T

import rope_extend
from rope_extend.cli import main
from rope_extend.export import export
from tests.tiny import tiny_model, tiny_tokenizer


def saved(tmp_path, family="llama"):
    folder = tmp_path / "model"
    tiny_model(family).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("method", "kwargs"),
    [
        ("linear", {}),
        ("yarn", {}),
        ("yarn", {"attention_factor": 1.3, "beta_fast": 16.0}),
        ("llama3", {}),
    ],
)
def test_transformers4_round_trip_gives_the_patched_logits(tmp_path, method, kwargs):
    model = tiny_model("llama")
    ids = torch.randint(3, 500, (1, 700))  # past the target of x2 (512)
    rope_extend.patch(model, method, factor=2.0, **kwargs)
    with torch.no_grad():
        expected = model(ids).logits
    export(model, "transformers4", tmp_path / "t4")
    config = json.loads((tmp_path / "t4" / "config.json").read_text())
    assert "rope_parameters" not in config and config["rope_scaling"]["rope_type"] == method
    assert config["rope_theta"] == 10000.0
    reloaded = T.AutoModelForCausalLM.from_pretrained(tmp_path / "t4").eval()
    with torch.no_grad():
        got = reloaded(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_engine_configs(tmp_path):
    folder = saved(tmp_path)
    r = export(str(folder), "sglang", tmp_path / "s", method="yarn", factor=4, attention_factor=1.5)
    rope = json.loads((tmp_path / "s" / "config.json").read_text())["rope_parameters"]
    assert rope["attention_factor"] == 1.5 and rope["attn_factor"] == pytest.approx(
        1.5 / (0.1 * 1.3862943611198906 + 1)
    )
    assert r.command.endswith("--context-length 1024") and (tmp_path / "s" / "model.safetensors").is_file()
    info = json.loads((tmp_path / "s" / "rope-extend-export.json").read_text())
    assert info["notes"] == r.notes and any("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1" in n for n in r.notes)
    export(str(folder), "vllm", tmp_path / "v", method="linear", factor=4)
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    assert config["max_position_embeddings"] == 256  # vLLM multiplies a linear config's length by its factor


def test_gguf_reads_back_with_the_same_logits(tmp_path):
    pytest.importorskip("gguf")
    model, tok = tiny_model("llama"), tiny_tokenizer()
    rope_extend.patch(model, "linear", factor=2.0)
    out = export(model, "gguf", tmp_path / "m.gguf", tokenizer=tok, tokenizer_pre="smollm").out
    from gguf import GGUFReader

    reader = GGUFReader(out)
    fields = {f.name: f for f in reader.fields.values()}
    assert bytes(fields["llama.rope.scaling.type"].parts[-1]).decode() == "linear"
    assert float(fields["llama.rope.scaling.factor"].parts[-1][0]) == 2.0
    # transformers' own GGUF reader undoes the query/key interleaving: the unscaled weights come back
    back = T.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf").eval()
    rope_extend.unpatch(model)
    ids = torch.randint(3, 500, (1, 64))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_gguf_unknown_tokenizer_is_refused_before_writing(tmp_path):
    pytest.importorskip("gguf")
    with pytest.raises(rope_extend.RopeExtendError, match="tokenizer_pre"):
        export(tiny_model("llama"), "gguf", tmp_path / "m.gguf", tokenizer=tiny_tokenizer())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--to", "vlm"], "unknown export target 'vlm'"),
        (["--to", "vllm", "--method", "rerope"], "cannot serve rerope"),
        (["--to", "vllm", "--method", "dynamic", "--factor", "2"], "pass --approximate"),
        (["--to", "gguf", "--method", "yarn", "--factor", "2"], "qwen2"),
    ],
)
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, capsys, args, message):
    folder = saved(tmp_path, "qwen2" if "gguf" in args else "llama")
    capsys.readouterr()
    assert main(["export", str(folder), "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_existing_out_and_non_rope_model(tmp_path, capsys):
    folder = saved(tmp_path)
    capsys.readouterr()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    assert main(["export", str(folder), "--to", "vllm", "--out", str(tmp_path / "out")]) == 2
    assert "exists" in capsys.readouterr().err and (tmp_path / "out" / "mine.txt").read_text() == "keep"
    gpt2 = tmp_path / "gpt2"
    T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(gpt2)
    capsys.readouterr()
    assert main(["export", str(gpt2), "--to", "vllm", "--out", str(tmp_path / "o2")]) == 2
    assert "does not use rotary" in capsys.readouterr().err and not (tmp_path / "o2").exists()


def test_result_names_the_override_flag(tmp_path):
    folder = saved(tmp_path)
    for to, flag in (("vllm", "--hf-overrides"), ("sglang", "--json-model-override-args")):
        r = export(str(folder), to, tmp_path / to, method="yarn", factor=4)
        assert r.override_flag == flag and r.overrides["rope_parameters"]["factor"] == 4
        assert r.as_dict()["override_argument"] == r.override_argument
        got = r.override_argument
        assert got.startswith(flag + " '") and json.loads(got[len(flag) + 2 : -1]) == r.overrides
    r = export(str(folder), "transformers4", tmp_path / "t4", method="yarn", factor=4)
    assert r.override_flag is None and r.override_argument is None and "override_flag" not in r.as_dict()
