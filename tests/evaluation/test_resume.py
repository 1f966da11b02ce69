import importlib
import json

import pytest

from rope_extend import RopeExtendError
from rope_extend.evaluation import passkey, perplexity, retrieval
from rope_extend.evaluation.records import RecordLog
from tests.evaluation.conftest import untimed

REAL_GREEDY = retrieval.greedy


class Boom(Exception):
    pass


def counting_greedy(monkeypatch, fail_after=None):
    calls = []
    real = REAL_GREEDY

    def greedy(*args):
        if fail_after is not None and len(calls) == fail_after:
            raise Boom("interrupted")
        calls.append(args[2])
        return real(*args)

    monkeypatch.setattr(retrieval, "greedy", greedy)
    return calls


def test_interrupted_passkey_keeps_records_and_resume_finishes_identically(llama, tok, tmp_path, monkeypatch):
    full = passkey(llama, tok, [128, 160], trials=3, seed=5, progress=False)
    path = tmp_path / "records.jsonl"
    counting_greedy(monkeypatch, fail_after=4)
    with pytest.raises(Boom):
        passkey(llama, tok, [128, 160], trials=3, seed=5, records=path, progress=False)
    assert len(path.read_text().splitlines()) == 4  # every finished trial is on disk
    calls = counting_greedy(monkeypatch)
    resumed = passkey(llama, tok, [128, 160], trials=3, seed=5, records=path, resume=True, progress=False)
    assert len(calls) == 2  # only the unfinished trials ran
    assert all(r["seconds"] >= 0 for r in resumed.records)  # each record times its own job
    setting = resumed.records[0]["setting"]
    assert [untimed(r) for r in resumed.records] == [{**untimed(r), "setting": setting} for r in full.records]
    assert resumed.accuracy == full.accuracy
    again = counting_greedy(monkeypatch)
    passkey(llama, tok, [128, 160], trials=3, seed=5, records=path, resume=True, progress=False)
    assert again == [] and len(path.read_text().splitlines()) == 6


def test_existing_results_need_resume(llama, tok, tmp_path):
    path = tmp_path / "records.jsonl"
    passkey(llama, tok, [128], trials=1, records=path, progress=False)
    before = path.read_text()
    with pytest.raises(RopeExtendError, match="already holds results.*resume"):
        passkey(llama, tok, [128], trials=1, records=path, progress=False)
    assert path.read_text() == before


def test_resume_with_other_settings_recomputes_and_keeps_old_records(llama, tok, tmp_path, monkeypatch):
    path = tmp_path / "records.jsonl"
    passkey(llama, tok, [128], trials=2, seed=0, records=path, progress=False)
    calls = counting_greedy(monkeypatch)
    r = passkey(llama, tok, [128], trials=2, seed=1, records=path, resume=True, progress=False)
    assert len(calls) == 2 and len(r.records) == 2
    assert len(path.read_text().splitlines()) == 4


def test_cut_off_last_line_is_redone(llama, tok, tmp_path, monkeypatch):
    path = tmp_path / "records.jsonl"
    passkey(llama, tok, [128], trials=2, records=path, progress=False)
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\n" + lines[1][:20])  # killed while writing the second record
    calls = counting_greedy(monkeypatch)
    r = passkey(llama, tok, [128], trials=2, records=path, resume=True, progress=False)
    assert len(calls) == 1 and len(r.records) == 2
    good = [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{") and x.endswith("}")]
    assert len(good) == 2 and RecordLog(path, resume=True).records == good


def test_perplexity_resume_skips_finished_documents(llama, tok, texts, tmp_path, monkeypatch):
    path = tmp_path / "ppl.jsonl"
    full = perplexity(llama, tok, texts, [64, 96], records=path, progress=False)
    module = importlib.import_module("rope_extend.evaluation.perplexity")
    seen = []
    real = module.window_nll
    monkeypatch.setattr(module, "window_nll", lambda *a, **k: seen.append(1) or real(*a, **k))
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:4]) + "\n")  # as if interrupted after 4 of 6 documents
    again = perplexity(llama, tok, texts, [64, 96], records=path, resume=True, progress=False)
    assert len(seen) == 2 and again.perplexity == pytest.approx(full.perplexity, rel=1e-12)


def test_perplexity_records_of_another_text_are_not_reused(llama, tok, texts, tmp_path, monkeypatch):
    # the same number of documents, other words: each record names its document's tokens, so a resumed run
    # (or --records-from another suite's report) never passes one text's perplexity off as another's
    path = tmp_path / "ppl.jsonl"
    first = perplexity(llama, tok, texts[:1], [64], records=path, progress=False)
    module = importlib.import_module("rope_extend.evaluation.perplexity")
    seen = []
    real = module.window_nll
    monkeypatch.setattr(module, "window_nll", lambda *a, **k: seen.append(1) or real(*a, **k))
    other = perplexity(llama, tok, texts[1:2], [64], records=path, resume=True, progress=False)
    alone = perplexity(llama, tok, texts[1:2], [64], progress=False)
    assert len(seen) == 2  # measured on the resumed run (and alone), not taken from the first text's record
    assert other.perplexity[64] == alone.perplexity[64] != first.perplexity[64]
    assert first.records[0]["text"] != other.records[0]["text"]
    seen.clear()
    perplexity(llama, tok, texts[:1], [64], records=path, resume=True, progress=False)
    assert seen == []  # its own text's record is still reused


def test_niah_records_of_another_haystack_are_not_reused(llama, tok, texts, tmp_path, monkeypatch):
    from rope_extend.evaluation import niah

    path = tmp_path / "niah.jsonl"
    niah(llama, tok, [texts[0] * 3], [128], depths=[0.5], records=path, progress=False)
    calls = counting_greedy(monkeypatch)
    niah(llama, tok, [texts[1] * 3], [128], depths=[0.5], records=path, resume=True, progress=False)
    assert len(calls) == 1
    calls.clear()
    niah(llama, tok, [texts[0] * 3], [128], depths=[0.5], records=path, resume=True, progress=False)
    assert calls == []


def test_more_trials_reuse_the_recorded_ones(llama, tok, tmp_path, monkeypatch):
    path = tmp_path / "records.jsonl"
    five = passkey(llama, tok, [128], trials=2, seed=3, records=path, progress=False)
    calls = counting_greedy(monkeypatch)
    more = passkey(llama, tok, [128], trials=4, seed=3, records=path, resume=True, progress=False)
    assert len(calls) == 2  # trials 0 and 1 are the same questions: only 2 and 3 ran
    assert more.records[:2] == five.records and len(path.read_text().splitlines()) == 4
    fresh = passkey(llama, tok, [128], trials=4, seed=3, progress=False)
    assert [r["correct"] for r in more.records] == [r["correct"] for r in fresh.records]
    assert [r["answer"] for r in more.records] == [r["answer"] for r in fresh.records]


def test_records_with_the_old_trial_count_setting_are_reused(llama, tok, tmp_path, monkeypatch):
    from rope_extend.evaluation.records import setting_id

    path = tmp_path / "records.jsonl"
    first = passkey(llama, tok, [128], trials=3, seed=2, records=path, progress=False)
    # rewrite the file as 0.1.0 wrote it: the trial count was part of the setting
    old = []
    for r in first.records:
        full = {
            k: v
            for k, v in r.items()
            if k
            not in (
                "setting",
                "length",
                "depth_grid",
                "trial",
                "depth",
                "actual_depth",
                "answer",
                "prediction",
                "output",
                "correct",
                "seconds",
                "cpu_seconds",
            )
        }
        setting = {"key_range": [1, 50000], "depths": None, "seed": 2, "max_new_tokens": 10, "trials": 3}
        old.append({**r, "setting": setting_id({**full, **setting})})
    assert old[0]["setting"] != first.records[0]["setting"]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    calls = counting_greedy(monkeypatch)
    again = passkey(llama, tok, [128], trials=5, seed=2, records=path, resume=True, progress=False)
    assert len(calls) == 2 and again.records[:3] == old


def test_trials_at_sets_the_count_per_length_and_reuses_the_common_trials(llama, tok, tmp_path, monkeypatch):
    path = tmp_path / "records.jsonl"
    two = passkey(llama, tok, [128, 160], trials=2, seed=4, records=path, progress=False)
    calls = counting_greedy(monkeypatch)
    more = passkey(
        llama, tok, [128, 160], trials=2, trials_at={"160": 5}, seed=4, records=path, resume=True, progress=False
    )
    assert [len(ids) for ids in calls] == [160, 160, 160]  # trials 2-4 at 160 only
    assert [(r["length"], r["trial"]) for r in more.records] == [(128, 0), (128, 1)] + [(160, t) for t in range(5)]
    assert more.records[:4] == two.records
    assert more.accuracy_by_length[160] == sum(r["correct"] for r in more.records[2:]) / 5


@pytest.mark.parametrize(
    ("trials_at", "match"),
    [
        ({"96": 3}, r"trials_at names 96, not among the lengths measured \(128, 160\)"),
        ({"128": 0}, r"trials_at\[128\] must be a positive integer"),
        ({"128": True}, r"trials_at\[128\] must be a positive integer"),
        ({"0.5k": 2, 512: 3}, "names length 512 twice"),
        ([5], "mapping of lengths to trial counts"),
        ({"ten": 2}, "a length must be a positive integer"),
    ],
)
def test_bad_trials_at_is_refused_before_any_trial(llama, tok, trials_at, match, monkeypatch):
    calls = counting_greedy(monkeypatch)
    with pytest.raises(RopeExtendError, match=match):
        passkey(llama, tok, [128, 160], trials=1, trials_at=trials_at, progress=False)
    assert calls == []


def test_records_from_a_report_or_a_records_file_are_reused(llama, tok, tmp_path, monkeypatch):
    from rope_extend.evaluation.records import earlier_records, import_records, read_records

    first = passkey(llama, tok, [128], trials=3, seed=6, records=tmp_path / "a" / "records.jsonl", progress=False)
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "results.json").write_text(json.dumps({"summary": {}, "records": first.records}))
    for source in (tmp_path / "a", tmp_path / "a" / "records.jsonl", tmp_path / "report"):
        assert read_records(source) == first.records
    target = tmp_path / "b" / "records.jsonl"
    # the same records: added once
    assert import_records(target, earlier_records([tmp_path / "report", tmp_path / "a"])) == 3
    assert import_records(target, earlier_records([tmp_path / "report"])) == 0
    calls = counting_greedy(monkeypatch)
    again = passkey(llama, tok, [128], trials=4, seed=6, records=target, resume=True, progress=False)
    assert len(calls) == 1 and again.records[:3] == first.records


@pytest.mark.parametrize(
    ("content", "name", "match"),
    [
        (None, "missing.jsonl", "no records at"),
        ("{", "results.json", "is not valid JSON"),
        ('{"summary": {}}', "results.json", "has no list of records"),
        ('{"length": 5}\n', "records.jsonl", "not a rope-extend record"),
    ],
)
def test_bad_records_sources_are_named(tmp_path, content, name, match):
    from rope_extend.evaluation.records import read_records

    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(RopeExtendError, match=match):
        read_records(path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(RopeExtendError, match="neither records.jsonl nor results.json"):
        read_records(tmp_path / "empty")
