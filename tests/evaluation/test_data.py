import json

import pytest

from rope_extend import RopeExtendError
from rope_extend.evaluation.data import load_texts, parse_depths, parse_length, parse_lengths


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
