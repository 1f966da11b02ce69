"""Exports of tiny models: configs each engine reads, a transformers-4 round trip, GGUF files read back, and
bad input (one line, exit 2, nothing written)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import numpy as np
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
    assert r.command.endswith("--context-length 1024 --dtype float32")
    assert (tmp_path / "s" / "model.safetensors").is_file()
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


def test_gguf_bf16_weights_are_torchs_bfloat16_rounding(tmp_path):
    """``dtype="bf16"``: each matrix stored as torch's own rounding to bfloat16 (norms stay f32)."""
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType, GGUFReader

    model, tok = tiny_model("llama"), tiny_tokenizer()
    out = export(model, "gguf", tmp_path / "m.gguf", tokenizer=tok, tokenizer_pre="smollm", dtype="bf16").out
    tensors = {t.name: t for t in GGUFReader(out).tensors}
    down, norm = tensors["blk.0.ffn_down.weight"], tensors["blk.0.attn_norm.weight"]
    assert down.tensor_type == GGMLQuantizationType.BF16 and norm.tensor_type == GGMLQuantizationType.F32
    stored = (
        torch.from_numpy(np.asarray(down.data).view(np.int16).copy())
        .view(torch.bfloat16)
        .reshape(model.model.layers[0].mlp.down_proj.weight.shape)
    )
    assert torch.equal(stored, model.model.layers[0].mlp.down_proj.weight.detach().to(torch.bfloat16))


def test_gguf_unknown_tokenizer_is_refused_before_writing(tmp_path):
    pytest.importorskip("gguf")
    with pytest.raises(rope_extend.RopeExtendError, match="tokenizer_pre"):
        export(tiny_model("llama"), "gguf", tmp_path / "m.gguf", tokenizer=tiny_tokenizer())
    assert list(tmp_path.iterdir()) == []


def test_bundled_model_exports_to_gguf_without_a_pre_tokenizer_name(tmp_path, capsys):
    """rope-extend knows the bundled tokenizer: llama.cpp's ``smollm`` split (checked in llama.cpp by
    test_engines.py)."""
    pytest.importorskip("gguf")
    from gguf import GGUFReader

    args = ["export", "bundled", "--to", "gguf", "--method", "yarn", "--factor", "2", "--out", str(tmp_path / "b.gguf")]
    assert main(args) == 0, capsys.readouterr().err
    field = GGUFReader(tmp_path / "b.gguf").fields["tokenizer.ggml.pre"]
    assert bytes(field.parts[field.data[0]]).decode() == "smollm"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--to", "vlm"], "unknown export target 'vlm'"),
        (["--to", "vllm", "--method", "rerope"], "cannot serve rerope"),
        (["--to", "vllm", "--method", "dynamic", "--factor", "2"], "pass --approximate"),
        (["--to", "gguf", "--method", "yarn", "--factor", "2"], "not 'phi'"),
    ],
)
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, capsys, args, message):
    folder = saved(tmp_path, "phi" if "gguf" in args else "llama")
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


@pytest.mark.parametrize("to", ["gguf", "vllm"])
def test_out_below_a_file_is_one_line_exit_2(tmp_path, capsys, to):
    folder = saved(tmp_path)
    (tmp_path / "afile").write_text("mine")
    capsys.readouterr()
    args = ["--method", "linear", "--factor", "2"] + (["--tokenizer-pre", "smollm"] if to == "gguf" else [])
    assert main(["export", str(folder), "--to", to, "--out", str(tmp_path / "afile" / "m.gguf"), *args]) == 2
    err = capsys.readouterr().err
    assert "afile is a file, not a folder" in err and err.count("\n") == 1 and "Traceback" not in err
    assert (tmp_path / "afile").read_text() == "mine"


def test_out_that_cannot_be_written_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    folder = saved(tmp_path)
    capsys.readouterr()
    # /proc takes no new folders, even for root (for whom os.access says yes): the write itself fails
    assert main(["export", str(folder), "--to", "vllm", "--out", "/proc/x"]) == 2
    err = capsys.readouterr().err
    assert "cannot write --out /proc/x: No such file or directory" in err and err.count("\n") == 1

    # a folder that refuses the write (a read-only folder for a non-root user)
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("shutil.copytree", refuse)
    assert main(["export", str(folder), "--to", "vllm", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "Permission denied" in err and err.count("\n") == 1 and not (tmp_path / "o").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder_is_refused_before_the_work(tmp_path, capsys):
    folder = saved(tmp_path)
    (tmp_path / "ro").mkdir(mode=0o555)
    capsys.readouterr()
    assert main(["export", str(folder), "--to", "vllm", "--out", str(tmp_path / "ro" / "m")]) == 2
    assert "cannot be written" in capsys.readouterr().err


def test_exported_files_get_normal_permissions(tmp_path):
    folder = saved(tmp_path)
    (folder / "model.safetensors").chmod(0o600)  # as a cached folder has it
    folder.chmod(0o700)
    mask = os.umask(0o022)
    try:
        export(str(folder), "vllm", tmp_path / "v", method="yarn", factor=2)
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "v").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "v" / "model.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "v" / "config.json").stat().st_mode) == 0o644


def _modes(path):
    """``{path: mode}`` of ``path`` and everything under it."""
    return {q: stat.S_IMODE(q.stat().st_mode) for q in [path, *(path.rglob("*") if path.is_dir() else [])]}


def test_saved_models_gguf_files_and_configured_copies_are_readable_by_others(tmp_path):
    """A server often runs as another user: every file an export or ``configure`` writes is 0644 under umask 022,
    every folder 0755, whether the weights come from a loaded model or a private (0600) cached folder."""
    pytest.importorskip("gguf")
    folder = saved(tmp_path)
    for item in folder.iterdir():
        item.chmod(0o600)
    folder.chmod(0o700)
    model = tiny_model("llama")
    rope_extend.patch(model, "yarn", factor=2.0)
    mask = os.umask(0o022)
    try:
        export(model, "vllm", tmp_path / "saved", tokenizer=tiny_tokenizer())
        export(model, "gguf", tmp_path / "m.gguf", tokenizer=tiny_tokenizer(), tokenizer_pre="smollm")
        assert main(["configure", str(folder), "--method", "yarn", "--factor", "2", "--out", str(tmp_path / "c")]) == 0
    finally:
        os.umask(mask)
    for out in ("saved", "m.gguf", "c"):
        modes = _modes(tmp_path / out)
        assert out == "m.gguf" or tmp_path / out / "model.safetensors" in modes
        for item, mode in modes.items():
            assert mode == (0o755 if item.is_dir() else 0o644), (item, oct(mode))


def test_self_extend_gguf_says_the_original_length(tmp_path):
    pytest.importorskip("gguf")
    from gguf import GGUFReader

    model, tok = tiny_model("llama"), tiny_tokenizer()  # L = 256
    rope_extend.patch(model, "self_extend", factor=3, group_size=4, window=64)
    r = export(model, "gguf", tmp_path / "m.gguf", tokenizer=tok, tokenizer_pre="smollm", approximate=True)
    fields = {f.name: f for f in GGUFReader(r.out).fields.values()}
    # plain RoPE holds to L: llama.cpp run without the group-attention flags serves (and warns) from there
    assert int(fields["llama.context_length"].parts[-1][0]) == 256
    assert " -c 768 " in r.command and "--grp-attn-n 4 --grp-attn-w 64" in r.command


def test_abandoned_temporaries_are_removed_and_nothing_else(tmp_path):
    from rope_extend.io import OWNER, _started, owned_tempdir

    folder = saved(tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = owned_tempdir(".v.", ".tmp", tmp_path)  # a killed export's folder: its process is gone
    owner = json.loads((dead / OWNER).read_text())
    (dead / OWNER).write_text(json.dumps({**owner, "pid": gone.pid, "started": "0"}))
    (dead / "v").mkdir()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    live = owned_tempdir(".v.", ".tmp", tmp_path)  # a running export's: in use
    (live / OWNER).write_text(json.dumps({**owner, "pid": running.pid, "started": _started(running.pid)}))
    reused = owned_tempdir(".v.", ".tmp", tmp_path)  # its pid now names a process started at another time
    (reused / OWNER).write_text(json.dumps({**owner, "pid": running.pid, "started": "0"}))
    elsewhere = owned_tempdir(".v.", ".tmp", tmp_path)  # another host's, on a shared disk: not provable
    (elsewhere / OWNER).write_text(json.dumps({**owner, "pid": gone.pid, "host": "another-host"}))
    unknown = tmp_path / ".v.abcd.tmp"  # no owner record (an older version's): not provable
    unknown.mkdir()
    mine = tmp_path / ".v.notes"  # a user's file that merely looks alike
    mine.write_text("keep")
    try:
        export(str(folder), "vllm", tmp_path / "v", method="yarn", factor=2)
    finally:
        running.kill()
        running.wait()
    assert not dead.exists() and not reused.exists()
    assert live.is_dir() and elsewhere.is_dir() and unknown.is_dir()
    assert mine.read_text() == "keep"


def test_cli_prints_a_readable_summary_and_json_on_request(tmp_path, capsys):
    folder = saved(tmp_path)
    args = ["export", str(folder), "--to", "vllm", "--method", "yarn", "--factor", "4"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["out:", str(tmp_path / "a")]
    assert ["target:", "vllm"] in [line.split() for line in lines]
    assert any(line.startswith("command:") and line.endswith("--max-model-len 1024 --dtype float32") for line in lines)
    # a note a line; past the target vLLM's rotary table has no rows (tests/export/test_vllm_engine.py runs it)
    note = "  - do not serve past 1024 tokens: vLLM's rotary table ends there (max_position_embeddings rows), so "
    assert note + "with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 every log-prob past it is NaN or garbage" in lines
    assert main([*args, "--out", str(tmp_path / "b"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["target"] == "vllm" and result["overrides"]["max_position_embeddings"] == 1024


@pytest.mark.parametrize(("dtype", "name"), [(torch.float32, "float32"), (torch.bfloat16, "bfloat16")])
def test_command_names_the_dtype_of_a_model_or_a_folder(tmp_path, dtype, name):
    # vLLM and SGLang load a float32 model in 16 bits unless --dtype says otherwise
    model = tiny_model("llama").to(dtype)
    r = export(model, "vllm", tmp_path / "m", method="yarn", factor=2)
    assert r.command.endswith(f"--max-model-len 512 --dtype {name}")
    folder = tmp_path / "f"
    model.save_pretrained(folder)
    r = export(str(folder), "sglang", tmp_path / "s", method="yarn", factor=2)
    assert r.command.endswith(f"--context-length 512 --dtype {name}")


@pytest.mark.parametrize(
    ("method", "says"),
    [
        ("linear", "do not serve past 1024 tokens: SGLang extends its rotary table past it with unscaled positions"),
        ("yarn", "past 1024 tokens (SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1) SGLang extends its rotary table"),
    ],
)
def test_notes_say_what_serving_past_the_target_gives(tmp_path, method, says):
    folder = saved(tmp_path)
    r = export(str(folder), "sglang", tmp_path / "s", method=method, factor=4)
    assert [n for n in r.notes if n.startswith(says)] and not any("ALLOW_LONG_MAX_MODEL_LEN" in n for n in r.notes)
    r = export(str(folder), "vllm", tmp_path / "v", method=method, factor=4)
    vllm_note = (
        "do not serve past 1024 tokens: vLLM's rotary table ends there (max_position_embeddings rows), so "
        "with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 every log-prob past it is NaN or garbage"
    )
    assert r.notes == [vllm_note]


def test_dynamic_exported_is_the_patched_model_at_the_target(tmp_path):
    """The bundled model (L = 256) with dynamic x4, exported static (--approximate): the served folder, read by
    transformers, gives the patched model's logits on a 1024-token sequence (the target), because the export
    takes the patched model's base there (alpha 13.4375 at its grid length 1052, test_routes)."""
    result = export("bundled", "vllm", tmp_path / "d", method="dynamic", factor=4, approximate=True)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": pytest.approx(23379.5329, abs=1e-4)}
    assert "at 1052" in result.notes[0]
    served = T.AutoModelForCausalLM.from_pretrained(tmp_path / "d", dtype=torch.float32).eval()
    patched = rope_extend.load("bundled")[0].float().eval()
    rope_extend.patch(patched, "dynamic", factor=4)
    ids = torch.randint(3, 1000, (1, 1024), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(served(ids).logits, patched(ids).logits, rtol=1e-5, atol=1e-5)


def test_gguf_context_past_a_uint32_is_one_line_before_anything(tmp_path, capsys):
    """GGUF's context_length is a uint32 (the gguf writer and llama.cpp's n_ctx_train): 2^32 - 1 tokens fits and is
    written; one token more names the factor, the length and the limit, exit 2, nothing written."""
    pytest.importorskip("gguf")
    from gguf import GGUFReader

    (tmp_path / "mine.txt").write_text("keep")
    limit = 2**32 - 1
    args = ["export", "bundled", "--to", "gguf", "--method", "yarn", "--out"]
    assert main([*args, str(tmp_path / "big.gguf"), "--factor", str(2**24)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert (
        f"factor 1.67772e+07 x L=256 gives a context of {2**32} tokens, past GGUF's context_length, a uint32 in the "
        f"file and in llama.cpp (at most {limit}): give a factor of at most {limit // 256} for L=256" in err
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]
    assert (tmp_path / "mine.txt").read_text() == "keep"
    assert main([*args, str(tmp_path / "edge.gguf"), "--factor", repr(limit / 256)]) == 0, capsys.readouterr().err
    field = GGUFReader(tmp_path / "edge.gguf").fields["llama.context_length"]
    assert int(field.parts[field.data[0]][0]) == limit


@pytest.mark.parametrize(
    "plant, said",
    [
        ("link", "config.json is a symbolic link: rope-extend never reads a file it wrote through a link"),
        ("list", "config.json holds a list, not a JSON object"),
    ],
)
def test_the_copied_config_is_read_as_the_exports_own(tmp_path, monkeypatch, capsys, plant, said):
    """The config the export rewrites is in its own temporary, just copied: a link planted there in between (here
    by the copy itself) is refused, not read and written through (before: the user's file it pointed to was
    overwritten with the exported config); a config that is no object is one line (before: a TypeError)."""
    from rope_extend.export import configs

    folder = saved(tmp_path)
    capsys.readouterr()  # the save's progress bars
    users = tmp_path / "users-notes.json"
    users.write_text('{"mine": true}\n')
    copytree = configs.shutil.copytree

    def copy_and_plant(src, dst, **kwargs):
        out = copytree(src, dst, **kwargs)
        config = os.path.join(dst, "config.json")
        os.remove(config)
        if plant == "link":
            os.symlink(users, config)
        else:
            with open(config, "w") as f:
                f.write("[1, 2]")
        return out

    monkeypatch.setattr(configs.shutil, "copytree", copy_and_plant)
    args = ["export", str(folder), "--to", "vllm", "--method", "yarn", "--factor", "2", "--out", str(tmp_path / "v")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rope-extend: error: ") and "\n" not in err, err
    assert said in err and err.endswith("the export's copy of the model folder was changed"), err
    assert users.read_text() == '{"mine": true}\n'
    assert not (tmp_path / "v").exists()
