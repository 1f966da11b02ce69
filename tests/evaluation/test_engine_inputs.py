"""What ``LlamaCppModel`` is given to open, checked before the engine runs: runs without llama-cpp-python (an
empty stand-in takes its place; the file is refused before the engine is reached), unlike ``test_engines.py``."""

from __future__ import annotations

import os
import sys
import types

import pytest

from rope_extend.errors import RopeExtendError
from rope_extend.evaluation.engines import LlamaCppModel
from tests.blocking import within


@pytest.fixture
def no_engine(monkeypatch):
    """An empty ``llama_cpp`` module: the import succeeds, and any use of the engine would fail the test."""
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))


def test_a_named_pipe_named_like_a_gguf_is_refused_not_waited_on(tmp_path, no_engine):
    """Its digest was taken with a plain ``open``, which waits for a writer for ever (the check before it was
    ``is_file``, which a pipe swapped in afterwards passes). Now the digest's own open refuses it at once."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(RopeExtendError) as err:
        within(10, lambda: LlamaCppModel(fifo, n_ctx=512), fifo)
    assert str(err.value) == f"{fifo} is a named pipe, not a regular file: give the path of a GGUF file"


def test_a_folder_a_device_or_nothing_is_one_line(tmp_path, no_engine):
    (tmp_path / "dir.gguf").mkdir()
    (tmp_path / "zero.gguf").symlink_to("/dev/zero")
    for name, said in [
        ("dir.gguf", "is a folder, not a file"),
        ("zero.gguf", "is a socket or device, not a regular file"),
        ("missing.gguf", ": no such file"),
    ]:
        with pytest.raises(RopeExtendError) as err:
            LlamaCppModel(tmp_path / name, n_ctx=512)
        assert (
            str(err.value)
            == f"{tmp_path / name}{'' if said.startswith(':') else ' '}{said}: give the path of a GGUF file"
        )
