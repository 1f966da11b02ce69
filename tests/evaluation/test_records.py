"""Records are checked by type when read: an edited or damaged record is refused with its file and line."""

import json

import pytest

from rope_extend.cli import main
from rope_extend.errors import RopeExtendError
from rope_extend.evaluation.passkey import passkey
from rope_extend.evaluation.records import RecordLog, read_records


@pytest.fixture(scope="module")
def records(llama, tok, tmp_path_factory):
    """Two real passkey records (the second one's line is the one edited below)."""
    path = tmp_path_factory.mktemp("run") / "records.jsonl"
    return passkey(llama, tok, [128], trials=2, seed=0, max_new_tokens=3, records=path, progress=False).records


def _edited(records, **fields):
    return [records[0], {**records[1], **fields}]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"correct": "false", "prediction": -1}, r"'correct' must be true or false, got 'false'"),
        ({"correct": 1}, r"'correct' must be true or false, got 1"),
        ({"length": "128"}, r"'length' must be an integer, got '128'"),
        ({"trial": True}, r"'trial' must be an integer, got True"),
        ({"prediction": [5]}, r"'prediction' must be an integer, a string or null"),
        ({"setting": 7}, r"'setting' must be a string"),
        ({"nll": float("nan")}, r"'nll' must be a finite number, got nan"),
    ],
)
def test_a_record_with_a_wrong_type_is_refused_with_its_line(records, tmp_path, fields, match):
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _edited(records, **fields)))
    with pytest.raises(RopeExtendError, match=rf"records\.jsonl:2: the record's {match}"):
        read_records(path)
    with pytest.raises(RopeExtendError, match=r"records\.jsonl:2: "):  # a resumed run reads its own file the same way
        RecordLog(path, resume=True)
    report = tmp_path / "results.json"
    report.write_text(json.dumps({"summary": {}, "records": _edited(records, **fields)}))
    with pytest.raises(RopeExtendError, match=rf"results\.json: records\[1\]: the record's {match}"):
        read_records(report)


def test_the_records_as_written_are_read_back(records, tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"task": "passk')  # a cut line is skipped
    assert read_records(path) == records
    assert isinstance(records[0]["prediction"], (int, type(None))) and isinstance(records[0]["correct"], bool)


def _cli(tmp_path, source, capsys):
    argv = ["eval", "passkey", "--model", "nowhere", "--lengths", "128", "--out", str(tmp_path / "out")]
    code = main([*argv, "--no-progress", "--records-from", str(source)])
    err = capsys.readouterr().err
    return code, err


def test_cli_refuses_an_edited_record_in_one_line(records, tmp_path, capsys):
    path = tmp_path / "a" / "records.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(r) + "\n" for r in _edited(records, correct="false", prediction=-1)))
    code, err = _cli(tmp_path, path.parent, capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"rope-extend: error: {path}:2: the record's 'correct' must be true or false")
    assert not (tmp_path / "out").exists()  # refused before anything is written


@pytest.mark.parametrize("name", ["records.jsonl", "results.json"])
def test_cli_refuses_a_records_file_that_is_not_utf8_in_one_line(tmp_path, capsys, name):
    path = tmp_path / name
    path.write_bytes(b'{"task": "passkey", "setting": "\xff\xfe"}\n')
    code, err = _cli(tmp_path, path, capsys)
    assert code == 2 and err.count("\n") == 1 and str(path) in err
    assert "is not a UTF-8 text file (byte 32)" in err
    assert not (tmp_path / "out").exists()
