import importlib
import json

import pytest

from rope_extend import RopeExtendError
from rope_extend.evaluation import passkey, perplexity, retrieval
from rope_extend.evaluation.records import RecordLog

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
    assert resumed.records == [{**r, "setting": resumed.records[0]["setting"]} for r in full.records]
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
            )
        }
        setting = {"key_range": [1, 50000], "depths": None, "seed": 2, "max_new_tokens": 10, "trials": 3}
        old.append({**r, "setting": setting_id({**full, **setting})})
    assert old[0]["setting"] != first.records[0]["setting"]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    calls = counting_greedy(monkeypatch)
    again = passkey(llama, tok, [128], trials=5, seed=2, records=path, resume=True, progress=False)
    assert len(calls) == 2 and again.records[:3] == old
