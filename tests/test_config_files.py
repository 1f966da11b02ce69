"""A model folder's config.json is a user's file, read as hostile (``loading``): whatever is wrong with it, every
command that loads a model or its config says it in one line naming the file and the field, exit 2, before
anything is written; a traceback from transformers (a strict dataclass field, a tensor of negative size) was the
outcome before."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from rope_extend.cli import main
from rope_extend.errors import RopeExtendError
from rope_extend.loading import load_config, load_model, model_config


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from tests.tiny import tiny_model, tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def _fields(**change):
    def plant(path: Path) -> None:
        path.write_text(json.dumps({**json.loads(path.read_text()), **change}))

    return plant


def _huge(path: Path) -> None:
    path.write_bytes(b"")
    os.truncate(path, 64 << 20)  # sparse: refused by its size, never read


CASES = {
    "string layers": (_fields(num_hidden_layers="four"), "Validation error for field 'num_hidden_layers'"),
    "negative hidden_size": (_fields(hidden_size=-64), "hidden_size must be an integer >= 1, got -64"),
    "zero vocab": (_fields(vocab_size=0), "vocab_size must be an integer >= 1, got 0"),
    "negative trained length": (
        _fields(max_position_embeddings=-8),
        "max_position_embeddings must be an integer >= 1, got -8",
    ),
    "fractional heads": (_fields(num_key_value_heads=1.5), "num_key_value_heads"),
    "not json": (lambda p: p.write_text("{not json"), "is not valid JSON (Expecting property name"),
    "a list": (lambda p: p.write_text(json.dumps([{"model_type": "llama"}])), "holds a list, not a JSON object"),
    "huge": (_huge, "is larger than 16777216 bytes"),
    "rope dict a string": (_fields(rope_parameters="yarn"), "is not a config transformers can read"),
}


def _commands(folder: Path, out: Path) -> dict[str, list[str]]:
    return {
        "configure": ["configure", str(folder), "--method", "yarn", "--factor", "2", "--out", str(out)],
        "eval": ["eval", "passkey", "--model", str(folder), "--lengths", "128", "--out", str(out), "--no-progress"],
    }


@pytest.mark.parametrize("case", list(CASES))
def test_a_planted_config_is_one_line_naming_it_for_every_command(saved, tmp_path, capsys, case):
    folder = tmp_path / "model"
    shutil.copytree(saved, folder)
    plant, said = CASES[case]
    plant(folder / "config.json")
    before = (folder / "config.json").read_bytes()
    for name, argv in _commands(folder, tmp_path / "out").items():
        capsys.readouterr()
        start = time.monotonic()
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (name, err)
        assert f"the config {folder / 'config.json'}" in err and said in err, (name, err)
        assert time.monotonic() - start < 30, name
        assert not (tmp_path / "out").exists() and (folder / "config.json").read_bytes() == before
    for read in (load_config, model_config, load_model):  # the Python API says the same
        with pytest.raises(RopeExtendError, match="config.json"):
            read(str(folder))


def test_a_named_pipe_for_config_json_is_refused_without_waiting(saved, tmp_path, capsys):
    """transformers would open it and wait for a writer for good."""
    folder = tmp_path / "model"
    shutil.copytree(saved, folder)
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")
    argv = _commands(folder, tmp_path / "out")["eval"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{folder / 'config.json'} is a named pipe, not a regular file" in err
    assert not (tmp_path / "out").exists()


def test_a_config_reached_through_a_link_is_read(saved, tmp_path):
    """A hub cache holds config.json as a link to a blob: a user's input is followed, and checked all the same."""
    folder = tmp_path / "model"
    shutil.copytree(saved, folder)
    blob = tmp_path / "blob"
    (folder / "config.json").rename(blob)
    (folder / "config.json").symlink_to(blob)
    assert load_config(folder).num_hidden_layers == 2
    _fields(hidden_size=-64)(blob)
    with pytest.raises(RopeExtendError, match=r"config\.json: hidden_size must be an integer >= 1, got -64"):
        load_config(folder)


def _header(path: Path, header: bytes) -> None:
    """A safetensors file of ``header`` (and no data)."""
    path.write_bytes(len(header).to_bytes(8, "little") + header)


WEIGHTS = {
    "fifo": (lambda p: (p.unlink(), os.mkfifo(p)), "a named pipe, not a regular file"),
    "huge header": (lambda p: p.write_bytes((1 << 40).to_bytes(8, "little")), "truncated: 8 bytes, shorter than"),
    "header past the bound": (
        lambda p: (p.write_bytes((200_000_000).to_bytes(8, "little")), os.truncate(p, 300_000_000)),
        "its header claims 200000000 bytes, more than safetensors reads (100000000)",
    ),
    "deep header": (lambda p: _header(p, b"[" * 100_000), "its header is not a safetensors header"),
}


@pytest.mark.parametrize("case", list(WEIGHTS))
def test_a_planted_weights_file_is_one_line_without_waiting_or_reading_it_whole(saved, tmp_path, capsys, case):
    """The weights' layout is checked before transformers reads them (``loading.check_weights``): from a regular
    file only, its header bounded and parsed as hostile JSON."""
    folder = tmp_path / "model"
    shutil.copytree(saved, folder)
    plant, said = WEIGHTS[case]
    plant(folder / "model.safetensors")
    start = time.monotonic()
    assert main(_commands(folder, tmp_path / "out")["eval"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"the model file {folder / 'model.safetensors'} is damaged ({said}" in err, err
    assert time.monotonic() - start < 30 and not (tmp_path / "out").exists()
