import json
import os
import time
from pathlib import Path

import pytest

from rope_extend import RopeExtendError
from rope_extend.documents import MAX_TEXT_BYTES, read_documents
from rope_extend.evaluation.data import load_texts, parse_depths, parse_length, parse_lengths
from tests.blocking import within


def test_parse_lengths():
    assert parse_lengths("1k, 2k,4096,512") == [512, 1024, 2048, 4096]
    assert parse_lengths([128, "0.5k", 128]) == [128, 512]
    assert parse_length("128k") == 131072 and parse_length("1m") == 1048576
    for bad in ("0", "-1", "1.5", "2.0001k", "x", True, 0, -3):
        with pytest.raises(RopeExtendError, match="positive integer"):
            parse_lengths([bad])


def test_parse_depths():
    assert parse_depths("grid:5") == [0, 0.25, 0.5, 0.75, 1]
    assert parse_depths("0%,50%,100%") == [0, 0.5, 1]
    assert parse_depths([1, 0.1]) == [0.1, 1]
    assert parse_depths(None) is None
    for bad in ("1.5", "-0.1", "110%", "grid:1", "deep"):
        with pytest.raises(RopeExtendError):
            parse_depths(bad)


def test_local_sources(tmp_path):
    (tmp_path / "one.txt").write_text("first document")
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "b.txt").write_text("bee")
    (folder / "a.txt").write_text("ay")
    (folder / "empty.txt").write_text("  \n")
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["x one", "x two", ""])))
    assert load_texts(tmp_path / "one.txt") == ["first document"]
    assert load_texts(folder) == ["ay", "bee"]
    assert load_texts(jsonl) == ["x one", "x two"]
    assert load_texts(jsonl, max_docs=1) == ["x one"]
    import datasets

    datasets.Dataset.from_dict({"body": ["p one", "p two"]}).to_parquet(str(tmp_path / "d.parquet"))
    assert load_texts(tmp_path / "d.parquet", text_field="body") == ["p one", "p two"]
    with pytest.raises(RopeExtendError, match="no column 'text'.*body"):
        load_texts(tmp_path / "d.parquet")


def test_missing_or_offline_sources(tmp_path, monkeypatch):
    with pytest.raises(RopeExtendError, match="not a local file or folder"):
        load_texts(tmp_path / "nope.jsonl")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(RopeExtendError, match="hub is offline"):
        load_texts("someone/some-dataset")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RopeExtendError, match="without .txt files"):
        load_texts(empty)


def test_default_texts_come_from_the_bundled_corpus():
    from rope_extend import bundled
    from rope_extend.evaluation.data import default_texts

    if not bundled.EVAL_CORPUS.is_file():
        with pytest.raises(RopeExtendError, match="pass --data"):
            default_texts()
    else:
        texts = default_texts()
        assert texts == bundled.eval_texts() and all(len(t) > 1000 for t in texts)


def test_reading_a_local_table_shows_no_progress_bars(tmp_path, capfd):
    import datasets

    from rope_extend.documents import read_documents

    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n')
    assert read_documents(path) == ["one", "two"]
    assert "Generating" not in capfd.readouterr().err
    assert datasets.utils.logging.is_progress_bar_enabled()  # the user's setting is put back


# --------------------------------------------------------------------- data files read as a user's, bounded
PIPE = "is a named pipe, not a regular file: give regular files"


def test_a_named_pipe_or_a_device_is_refused_wherever_it_is_named(tmp_path):
    """A named pipe (whose read blocks until someone writes) and a link to ``/dev/zero`` (which never ends), given
    by name, in a folder or by a pattern: one line naming what it is. Before, given by name they were "not a
    local file or folder"; in a folder or a pattern they were left out of the corpus, unsaid."""
    (tmp_path / "ok.txt").write_text("a story")
    fifo = tmp_path / "notes.txt"
    os.mkfifo(fifo)
    for source in (fifo, tmp_path, str(tmp_path / "*.txt"), [tmp_path / "ok.txt", fifo]):
        with pytest.raises(RopeExtendError, match=f"^{fifo} {PIPE}"):
            within(10, lambda source=source: read_documents(source), fifo)
    fifo.unlink()
    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    for source in (tmp_path / "zero.txt", tmp_path):
        with pytest.raises(RopeExtendError, match="zero.txt is a socket or device, not a regular file"):
            within(10, lambda source=source: read_documents(source), fifo)
    (tmp_path / "zero.txt").unlink()
    (tmp_path / "gone.txt").symlink_to(tmp_path / "nothing")
    with pytest.raises(RopeExtendError, match=r"gone.txt is a link to nothing"):
        read_documents(tmp_path)
    (tmp_path / "gone.txt").unlink()
    os.mkfifo(tmp_path / "rows.jsonl")  # the tables are read by datasets: refused before it opens one
    with pytest.raises(RopeExtendError, match=f"rows.jsonl {PIPE}"):
        within(10, lambda: read_documents(tmp_path / "rows.jsonl"), tmp_path / "rows.jsonl")
    (tmp_path / "rows.jsonl").unlink()
    assert read_documents(tmp_path) == ["a story"]  # a folder of regular files reads as before


def test_a_pipe_swapped_in_after_the_check_is_refused_at_the_open(tmp_path, monkeypatch):
    """The file is found as a regular file, then replaced by a named pipe before it is read (planted here by
    making the check say "a file"): the read itself refuses it. Before, it waited for a writer for ever."""
    fifo = tmp_path / "story.txt"
    os.mkfifo(fifo)
    is_file = Path.is_file
    monkeypatch.setattr(Path, "is_file", lambda self: self == fifo or is_file(self))
    with pytest.raises(RopeExtendError, match=f"^{fifo} is a named pipe, not a regular file: a text source is"):
        within(10, lambda: read_documents(fifo), fifo)


@pytest.mark.parametrize("name", ["x.jsonl", "x.parquet"])
def test_a_table_swapped_for_a_pipe_after_the_check_is_refused_before_datasets_reads_it(tmp_path, monkeypatch, name):
    """JSON lines and Parquet go to the datasets library, which opens them itself: a file found regular, then
    replaced by a named pipe (planted by making the first check say "a file"), is refused by ``untrusted``'s
    regular-file check made right before they are handed over, at once, naming what it is. Before, it went to
    datasets, whose own listing passes over a pipe: "cannot read x.jsonl as json: Unable to find 'x.jsonl'", the
    wrong cause for a file that is there."""
    fifo = tmp_path / name
    os.mkfifo(fifo)
    is_file = Path.is_file
    monkeypatch.setattr(Path, "is_file", lambda self: self == fifo or is_file(self))
    with pytest.raises(RopeExtendError, match=f"^{fifo} {PIPE}"):
        within(20, lambda: read_documents(fifo), fifo)


def test_a_text_file_past_the_limit_is_refused_before_it_is_read(tmp_path):
    """A sparse file one byte past ``MAX_TEXT_BYTES`` (1 GiB; it takes no disk): refused by its size, at once and
    without reading it, naming the limit and what to do. Before, it was read whole into memory."""
    big = tmp_path / "corpus.txt"
    with open(big, "wb") as f:
        f.truncate(MAX_TEXT_BYTES + 1)
    start = time.perf_counter()
    with pytest.raises(RopeExtendError) as err:
        read_documents(big)
    assert time.perf_counter() - start < 2
    assert str(err.value) == (
        f"{big} is larger than {MAX_TEXT_BYTES} bytes: a text source is a regular file of UTF-8 text of at most "
        "1 GiB (split a larger one into several files, a folder of them is one source, or give it as JSON lines or "
        "Parquet)"
    )
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(RopeExtendError, match=r"latin1.txt is not UTF-8 text \(byte 3\): a text source is"):
        read_documents(tmp_path / "latin1.txt")
