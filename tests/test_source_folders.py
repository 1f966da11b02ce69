"""The model folder ``configure`` and the folder exports copy (``io.copy_folder``, one function for both) is read as
a user's: a named pipe, a device, a link to nothing or to a folder in it is one line naming the entry and what it
is, exit 2, before anything is copied, with nothing written and the folder as it was. Before, a pipe ended in
"cannot write --out ...: Error; give a path you can write" (the wrong cause: the copy of the source failed, not
the write), a link to a device was copied as a file (``/dev/zero``: until the disk filled), and a link to a folder
was copied through (a link back into the folder: until the path grew too long). A link to a regular file is
followed, as the hub's cache keeps every file as a link to a blob."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from rope_extend.cli import main
from rope_extend.errors import RopeExtendError
from tests.blocking import within
from tests.test_output_folders import _snapshot
from tests.tiny import tiny_model, tiny_tokenizer

COMMANDS = {
    "configure": ["configure", "{src}", "--method", "yarn", "--factor", "2"],
    "export": ["export", "{src}", "--to", "vllm", "--method", "yarn", "--factor", "2"],
}
FIX = "a model folder that is copied may hold only files (or links to files) and folders: move it out of {src}"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "tiny"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _fifo(path: Path) -> str:
    os.mkfifo(path)
    return "a named pipe, not a regular file"


def _device(path: Path) -> str:  # /dev/null, not /dev/zero: the code before the fix copies a device for ever
    path.symlink_to("/dev/null")
    return "a link to /dev/null, a socket or device, not a regular file"


def _nothing(path: Path) -> str:
    path.symlink_to(path.parent / "gone")
    return f"a link to nothing ({path.parent / 'gone'})"


def _folder_link(path: Path) -> str:
    path.symlink_to(path.parent.parent, target_is_directory=True)  # back into the model folder: a copy without end
    return f"a link to a folder ({path.parent.parent}), not a file"


PLANTS = {"fifo": _fifo, "device": _device, "dangling link": _nothing, "folder link": _folder_link}


def run(capsys, args: list[str], fifo: Path | None = None) -> tuple[int, str]:
    capsys.readouterr()
    code = within(60, lambda: main(args), fifo)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("plant", list(PLANTS))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_entry_that_is_no_file_is_named_before_anything_is_copied(model_folder, tmp_path, capsys, command, plant):
    src = tmp_path / "src"
    shutil.copytree(model_folder, src)
    (src / "extra").mkdir()  # in a subfolder: the check walks the whole folder, as the copy does
    bad = src / "extra" / "notes.txt"
    kind = PLANTS[plant](bad)
    before = _snapshot(tmp_path)
    out = tmp_path / "out"
    args = [a.format(src=src) for a in COMMANDS[command]] + ["--out", str(out)]
    code, err = run(capsys, args, bad if plant == "fifo" else None)
    assert code == 2, err
    assert err.strip() == f"rope-extend: error: {bad} is {kind}: {FIX.format(src=src)}"
    assert _snapshot(tmp_path) == before  # no --out, no temporary beside it, the source as it was


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_folder_of_links_to_files_is_copied_as_files(model_folder, tmp_path, capsys, command):
    """As the hub's cache keeps a snapshot: every file a link to a blob outside the folder."""
    blobs, src = tmp_path / "blobs", tmp_path / "snapshot"
    shutil.copytree(model_folder, blobs)
    src.mkdir()
    for f in blobs.iterdir():
        (src / f.name).symlink_to(f)
    out = tmp_path / "out"
    code, err = run(capsys, [a.format(src=src) for a in COMMANDS[command]] + ["--out", str(out)])
    assert code == 0, err
    weights = out / "model.safetensors"
    assert not weights.is_symlink() and weights.read_bytes() == (blobs / "model.safetensors").read_bytes()
    assert (out / "tokenizer.json").read_bytes() == (blobs / "tokenizer.json").read_bytes()


def test_a_pipe_swapped_in_after_the_check_is_refused_at_the_open(tmp_path, monkeypatch):
    """The folder passes the check, then a file becomes a named pipe before it is copied (planted here by making
    the check pass): the copy opens each file as ``untrusted`` does and refuses it, at once."""
    import rope_extend.io
    from rope_extend.io import copy_folder

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.json").write_text("{}")
    os.mkfifo(src / "b.bin")
    monkeypatch.setattr(rope_extend.io, "check_folder", lambda *a, **k: None)
    with pytest.raises(RopeExtendError) as err:
        within(30, lambda: copy_folder(src, tmp_path / "dest"), src / "b.bin")
    assert str(err.value) == f"{src / 'b.bin'} is a named pipe, not a regular file: {FIX.format(src=src)}"
