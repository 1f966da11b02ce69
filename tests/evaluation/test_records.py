"""Records are checked by type when read: an edited or damaged record is refused with its file and line."""

import json
import warnings

import pytest

from rope_extend.cli import main
from rope_extend.errors import RopeExtendError
from rope_extend.evaluation.passkey import passkey
from rope_extend.evaluation.records import RecordLog, earlier_records, read_records


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
        ({"length": "128"}, r"'length' must be an integer >= 1, got '128'"),
        ({"trial": True}, r"'trial' must be an integer >= 0, got True"),
        ({"prediction": [5]}, r"'prediction' must be an integer, a string or null"),
        ({"setting": 7}, r"'setting' must be a string"),
        ({"nll": float("nan")}, r"'nll' must be a finite number >= 0, got nan"),
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


def test_records_written_before_the_model_digest_are_named_in_a_warning(records, tmp_path):
    """Such records are never reused (their setting lacks the digest): a run says so instead of measuring them
    again in silence (the committed eval/reports/smollm2-32k-eval is such a source)."""
    old = [{k: v for k, v in r.items() if k != "model_digest"} for r in records[:1]] + records[1:]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    with pytest.warns(UserWarning, match=r"records\.jsonl: 1 of 2 records were written before .* measured again"):
        assert earlier_records([path]) == old
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert earlier_records([path]) == records


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
    assert "is not UTF-8 text (byte 32)" in err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------ values out of their range
@pytest.fixture(scope="module")
def documents(llama, tok, tmp_path_factory):
    """Two real perplexity records."""
    from rope_extend.evaluation.perplexity import perplexity
    from tests.evaluation.conftest import make_text

    path = tmp_path_factory.mktemp("ppl") / "records.jsonl"
    texts = [make_text(60, seed=i) for i in range(2)]
    return perplexity(llama, tok, texts, [64], records=path, progress=False).records


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"tokens": -63}, r"'tokens' must be an integer >= 1, got -63"),
        ({"tokens": 0}, r"'tokens' must be an integer >= 1, got 0"),
        ({"nll": -1.0}, r"'nll' must be a finite number >= 0, got -1.0"),
        ({"perplexity": float("inf")}, r"'perplexity' must be a finite number >= 1, got inf"),
        ({"perplexity": 0.43}, r"'perplexity' must be a finite number >= 1, got 0.43"),
        ({"length": 0}, r"'length' must be an integer >= 1, got 0"),
        ({"doc": -1}, r"'doc' must be an integer >= 0, got -1"),
        ({"seconds": -0.5}, r"'seconds' must be a finite number >= 0, got -0.5"),
        ({"factor": 0}, r"'factor' must be a finite number > 0, got 0"),
        ({"stride": -4}, r"'stride' must be an integer >= 1 or null, got -4"),
        # in range each, but not what the harness computed from the others: an edited count
        ({"tokens": 5}, r"'perplexity' \S+ is not exp\(nll / tokens\) = "),
    ],
)
def test_a_perplexity_record_out_of_range_is_refused_with_its_line(documents, tmp_path, fields, match):
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _edited(documents, **fields)))
    before = path.read_bytes()
    with pytest.raises(RopeExtendError, match=rf"records\.jsonl:2: the record's {match}.*remove or repair that line"):
        RecordLog(path, resume=True)
    with pytest.raises(RopeExtendError, match=rf"records\.jsonl:2: the record's {match}"):
        read_records(path)
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"score": float("nan")}, r"'score' must be a number in \[0, 1\], got nan"),
        ({"score": 1.5}, r"'score' must be a number in \[0, 1\], got 1.5"),
        ({"score": -0.25, "correct": False}, r"'score' must be a number in \[0, 1\], got -0.25"),
        ({"depth": 2.0}, r"'depth' must be a number in \[0, 1\], got 2.0"),
        ({"actual_depth": float("-inf")}, r"'actual_depth' must be a number in \[0, 1\], got -inf"),
        ({"depth_grid": 1.01}, r"'depth_grid' must be a number in \[0, 1\] or null, got 1.01"),
        ({"trial": -2}, r"'trial' must be an integer >= 0, got -2"),
        ({"task_version": 0}, r"'task_version' must be an integer >= 1, got 0"),
        ({"answers": ["a", 3]}, r"'answers' must be a list of strings, got \['a', 3\]"),
        ({"score": 0.5, "correct": True}, r"'correct' True does not follow its 'score' 0.5"),
    ],
)
def test_a_retrieval_record_out_of_range_is_refused_with_its_line(records, tmp_path, fields, match):
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _edited(records, **fields)))
    with pytest.raises(RopeExtendError, match=rf"records\.jsonl:2: the record's {match}"):
        read_records(path)
    report = tmp_path / "results.json"
    report.write_text(json.dumps({"summary": {}, "records": _edited(records, **fields)}))
    with pytest.raises(RopeExtendError, match=rf"results\.json: records\[1\]: the record's {match}"):
        read_records(report)


def test_a_resumed_run_never_reuses_a_forged_count(llama, tok, documents, tmp_path):
    """The issue's case: a record whose token count was made negative would turn the perplexity into another
    number (0.43 for 2.32); the resumed run refuses it, naming the line, and writes nothing."""
    from rope_extend.evaluation.perplexity import perplexity
    from tests.evaluation.conftest import make_text

    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _edited(documents, tokens=-documents[1]["tokens"])))
    before = path.read_bytes()
    texts = [make_text(60, seed=i) for i in range(2)]
    with pytest.raises(RopeExtendError, match=r"records\.jsonl:2: the record's 'tokens' must be an integer >= 1"):
        perplexity(llama, tok, texts, [64], records=path, resume=True, progress=False)
    assert path.read_bytes() == before


def test_a_record_that_would_be_refused_is_never_written(tmp_path):
    path = tmp_path / "records.jsonl"
    log = RecordLog(path)
    log.add({"task": "perplexity", "setting": "s", "length": 64, "nll": 1.0, "tokens": 2, "perplexity": 1.6487212707})
    before = path.read_bytes()
    with pytest.raises(RopeExtendError, match=r"the record to append: the record's 'nll' must be a finite number"):
        log.add({"task": "perplexity", "setting": "s", "length": 64, "nll": float("nan"), "tokens": 2})
    assert path.read_bytes() == before and len(log.records) == 1


def test_every_shipped_record_is_in_range():
    """The reports committed in eval/reports were written by the harnesses: every one of their records passes."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "eval" / "reports"
    files = sorted(root.glob("*/records.jsonl"))
    assert files, root
    assert sum(len(read_records(f)) for f in files) > 500


# ------------------------------------------------------------------------------------ the records file itself
def test_a_records_path_that_is_not_a_plain_file_is_refused(tmp_path):
    from rope_extend.evaluation.records import check_records_file

    folder = tmp_path / "a" / "records.jsonl"
    folder.mkdir(parents=True)
    for resume in (False, True):
        with pytest.raises(RopeExtendError, match=r"records\.jsonl is a folder: it must be the records file"):
            check_records_file(folder, resume=resume)
    mine = tmp_path / "mine.txt"
    mine.write_text("a user's file\n")
    link = tmp_path / "b" / "records.jsonl"
    link.parent.mkdir()
    link.symlink_to(mine)
    with pytest.raises(RopeExtendError, match=r"records\.jsonl is a symbolic link"):
        RecordLog(link)
    dangling = tmp_path / "c" / "records.jsonl"
    dangling.parent.mkdir()
    dangling.symlink_to(tmp_path / "nowhere.jsonl")
    with pytest.raises(RopeExtendError, match=r"records\.jsonl is a symbolic link"):
        RecordLog(dangling, resume=True)
    assert mine.read_text() == "a user's file\n" and not (tmp_path / "nowhere.jsonl").exists()
    assert check_records_file(tmp_path / "d" / "records.jsonl", resume=True) == []  # none yet: nothing to check


def test_a_line_nested_too_deep_is_refused_with_its_line(records, tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(records[0]) + "\n" + "[" * 200_000 + "]" * 200_000 + "\n")
    with pytest.raises(
        RopeExtendError, match=r"records\.jsonl:2 is nested too deeply to be read as JSON: remove that line"
    ):
        read_records(path)
    report = tmp_path / "results.json"
    report.write_text('{"records": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(
        RopeExtendError, match=r"results\.json is nested too deeply to be read as JSON: give a results\.json"
    ):
        read_records(report)


def test_a_records_file_larger_than_any_run_writes_is_refused_unread(tmp_path, monkeypatch):
    from rope_extend.evaluation import records as records_module

    monkeypatch.setattr(records_module, "MAX_BYTES", 100)
    path = tmp_path / "records.jsonl"
    path.write_text("x" * 101)
    with pytest.raises(RopeExtendError, match=r"records\.jsonl is larger than"):
        read_records(path)


def test_eval_resume_with_a_folder_for_records_is_refused_before_the_model_loads(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "records.jsonl").mkdir(parents=True)
    (out / ".rope-extend").write_text(json.dumps({"kind": "eval", "tool": "rope-extend"}))
    argv = ["eval", "passkey", "--model", "nowhere", "--lengths", "128", "--out", str(out), "--resume"]
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1  # the folder, not the model named nowhere: it was never loaded
    assert f"{out / 'records.jsonl'} is a folder: it must be the records file rope-extend wrote" in err
    assert sorted(p.name for p in out.iterdir()) == [".rope-extend", "records.jsonl"]


def test_a_suite_resumed_with_a_folder_for_records_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    from rope_extend.evaluation import compare
    from rope_extend.evaluation.suite import load_suite

    out = tmp_path / "out"
    (out / "records.jsonl").mkdir(parents=True)
    (out / ".rope-extend").write_text(json.dumps({"kind": "eval", "tool": "rope-extend"}))
    monkeypatch.setattr(compare, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(RopeExtendError, match=r"records\.jsonl is a folder: it must be the records file"):
        compare.run_suite(load_suite("smoke"), out=out, resume=True, progress=False)


def test_a_link_put_in_place_of_the_records_file_mid_run_is_not_written_through(tmp_path):
    path = tmp_path / "records.jsonl"
    log = RecordLog(path)
    record = {"task": "toy", "setting": "s", "length": 8}
    log.add(record)
    mine = tmp_path / "mine.txt"
    mine.write_text("a user's file\n")
    path.unlink()
    path.symlink_to(mine)
    with pytest.raises(RopeExtendError, match=r"records\.jsonl is a symbolic link"):
        log.add(record)
    assert mine.read_text() == "a user's file\n"


def test_a_huge_value_in_a_record_is_shown_short_and_quickly(records):
    """The refusal shows the value bounded (``untrusted.shown``), computed without walking the whole value: a
    repr of 50 million list items or a 200 MB string would take seconds and fill the terminal."""
    import time

    from rope_extend.evaluation.records import check_record

    values = (list(range(50_000_000)), "7" * (200 << 20), {str(i): i for i in range(2_000_000)})
    start = time.monotonic()
    for value in values:
        with pytest.raises(RopeExtendError) as info:
            check_record({**records[1], "length": value}, "records.jsonl:2")
        assert str(info.value).startswith("records.jsonl:2: the record's 'length' must be an integer >= 1, got ")
        assert len(str(info.value)) < 250
        with pytest.raises(RopeExtendError, match=r"^records\.jsonl:2: not a rope-extend record") as info:
            check_record([value], "records.jsonl:2")
        assert len(str(info.value)) < 200
    assert time.monotonic() - start < 1


def test_cli_refuses_a_records_line_with_a_5000_digit_number_in_one_line(tmp_path, capsys):
    """A line with a number past Python's 4300 digits was made, not cut short by a kill: refused in one line (it
    was a ValueError traceback)."""
    path = tmp_path / "records.jsonl"
    path.write_text('{"task": "passkey", "setting": "s", "length": ' + "1" * 5000 + "}\n")
    code, err = _cli(tmp_path, path, capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{path}:1 is not valid JSON (Exceeds the limit (4300 digits)" in err
    assert not (tmp_path / "out").exists()
